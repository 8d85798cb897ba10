"""The NVRx room: the only package of the trainer that imports `nvidia_resiliency_ext`.

NVIDIA Resiliency Extension 0.7.0 gives the trainer its launcher (`ft_launcher`), the per-rank
heartbeat monitors, the in-process restart wrapper and the async checkpoint writer; this package
is where the trainer meets it, and nowhere else does (an import-linter contract says so). Every
patch of NVRx's code, and every use of one of its private attributes, lives here next to its
reason and is declared with the functions it was written against (`guards`); a guard test fails
loudly when an installed NVRx differs (tests/unit/test_trainer_nvrx_guards.py). Upgrading NVRx
means reading this folder.

Which process imports what:

- `launcher`, `monitorstate`: the launcher shim (rtj_trainer.launcher), in the ft_launcher
  process; their patches reach the rank monitor processes, which ft_launcher forks from it.
- `inprocess`, `monitor`, `store`: the training worker (rtj_trainer.resiliency,
  rtj_trainer.podloss): the in-process wrapper, the rank-monitor client, the wrapper's store.
- `asyncwriter`: the training worker's checkpointer (rtj_trainer.checkpoint), which spawns NVRx's
  persistent writer process; that process runs rtj_trainer.checkpoint.writer.
- `preload`: the warm workers (rtj_trainer.warm.worker) import it by name.

Every module imports NVRx lazily (inside functions), so that importing this package costs
nothing: the launcher shim starts its warm workers before NVRx is imported. This package imports
only the trainer's ground floor (rtj_wire, `errors`, `timeline`); what it calls back into the
worker (checkpoint closing, gloo cuts, the pod-loss listener) it receives as callables.

The upstream reports for the NVRx bugs that some patches work around are in docs/nvrx.md,
"Upstream reports".
"""

from .guards import NVRX_VERSION, Patch, installed_version

__all__ = ["NVRX_VERSION", "all_patches", "installed_version"]


def all_patches() -> tuple[Patch, ...]:
    """Every patch of NVRx the trainer makes, and every private attribute it relies on."""
    from . import asyncwriter, inprocess, launcher, monitorstate, store

    return (launcher.PATCHES + monitorstate.PATCHES + inprocess.PATCHES + store.PATCHES
            + asyncwriter.PATCHES)
