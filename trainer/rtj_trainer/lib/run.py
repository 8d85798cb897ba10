"""`Run`: one worker's side of a job, for a team's own script (the package docstring shows the
four lines a script adds).

What `init` does, once per worker, after the script's `init_process_group`:

- reads the job's settings from the pod's environment (rtj_wire.env: the checkpoint directory,
  interval and keep; the metrics port; the job's identity) the way the built-in trainer does
  (rtj_trainer.config);
- serves the rank's metrics page (step, loss, heartbeat, commits, goodput: what the operator shows
  in `kubectl get rtj`) and, under ft_launcher, connects to the rank's NVRx rank monitor (hang
  detection in the pod);
- registers for the checkpoint-and-stop signal (rtj_trainer.stop) and arms it;
- resumes: loads the newest checkpoint every rank finds valid into `state` (collective) and sets
  `start_step` (0 when there is none).

`state` maps names to what the script trains: `nn.Module`s (FSDP2 or not), optimizers (with
exactly one module in `state`: the one they train, as torch.distributed.checkpoint's state-dict
API needs), anything with `state_dict()`/`load_state_dict()` (a scheduler, a data loader), and
plain data (tensors, numbers, strings, lists and dicts of them), which a resume replaces in
`state`. Checkpoints are the trainer's own: per-rank shards written by NVRx's async writer,
committed by a manifest (rtj_trainer.checkpoint), resumed at the same world size.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

from .. import termination
from ..carry import CarryOver
from ..checkpoint import Checkpointer, CommitTimeoutError, job_identity
from ..checkpoint.reshard import SHARDING
from ..checkpoint.staging import map_leaves
from ..config import (
    CheckpointConfig,
    ConfigError,
    JobConfig,
    MetricsConfig,
)
from ..configload import environment_overrides
from ..launchenv import launch_environment
from ..ledger import LEDGER_FILE, Ledger, advance_ledger
from ..metrics import Snapshot, TrainerMetrics
from ..nvrx import monitor
from ..parallel import into_template, sharding, to_local
from ..stop import (
    STOP,
    STOP_NOT_COMMITTED,
    StopAgreement,
    exit_now,
    stop_exit_code,
    torch_reduce,
)
from ..stop import register as register_stop_signal

log = logging.getLogger("rtj_trainer.lib")

RESERVED = "__rtj__"
"""The key of the library's own record in a checkpoint (step, loss, productive seconds)."""


@dataclass(slots=True)
class _Progress:
    step: int = 0
    loss: float = float("nan")
    step_seconds: float = 0.0
    productive_seconds: float = 0.0
    heartbeat: float = 0.0
    last_step_at: float | None = None
    steps_this_attempt: int = 0
    saved_step: int | None = None
    stall_seconds: float = 0.0
    stopped: bool = False
    everyone_stopped: bool = False
    stop_committed: bool = True
    """False: the stop gave up waiting for its checkpoint (its budget ran out: `Run._stop`)."""
    ledger: Ledger | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class Run:
    """One worker's side of a job (see the module docstring). Use `init`."""

    def __init__(self, state: dict[str, Any] | None, *, checkpoint: CheckpointConfig,
                 job: JobConfig, metrics: MetricsConfig, nvrx_heartbeats: bool = True) -> None:
        if not dist.is_initialized():
            raise RuntimeError("rtj_trainer.lib.init: call torch.distributed.init_process_group "
                               "first (the library's checkpoints and stop agreement are "
                               "collectives)")
        if state is not None:
            _check_state(state)
        self.state = state
        """What the library checkpoints (None: the script checkpoints on its own, e.g. Hugging
        Face `Trainer`; the library then reports its saves through `committed`)."""
        self.cfg = checkpoint
        self.job = job
        self.launch = launch_environment()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if backend == "nccl" else torch.device("cpu"))
        self._progress = _Progress()
        self._external: tuple[int, float, str | None] | None = None
        self._client: Any = None
        if nvrx_heartbeats and self.launch.under_rank_monitor:
            self._client = monitor.client()
            self._client.init_workload_monitoring()
        self.metrics = TrainerMetrics(rank=self.rank, local_rank=self.launch.local_rank,
                                      job=job.name, attempt=job.attempt)
        if metrics.port is not None:
            self.metrics.serve(metrics.host, metrics.port)
        identity = _agree_on_identity(job, self.launch.launcher_restart_count)
        root = Path(checkpoint.dir)
        root.mkdir(parents=True, exist_ok=True)
        # With no state to save, no writer process is started (interval 0).
        self.checkpointer = Checkpointer(
            checkpoint if state is not None else checkpoint.model_copy(
                update={"interval_steps": 0}),
            root=root, rank=self.rank, world_size=self.world_size,
            device=self.device, identity=identity,
            job=job_identity(job.namespace, job.name), accepted_jobs=checkpoint.resume_from_jobs,
            keepalive=self.heartbeat, carry=CarryOver())
        self._agreement = StopAgreement(torch_reduce(self.device),
                                        check_every=checkpoint.stop_check_every_steps)
        self.start_step = self._resume()
        """The step the run resumed from (0: none): train from `start_step + 1`."""
        self.metrics.watch(self.snapshot)
        register_stop_signal()
        STOP.arm()

    # -- what the script calls ------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Tell every watchdog this rank is alive (the NVRx rank monitor and the operator's
        view); `step` does it, call it too during long work between steps (an evaluation)."""
        if self._client is not None and self._client.is_initialized and not STOP.requested:
            self._client.send_heartbeat()
        self._progress.heartbeat = time.time()

    def step(self, step: int, loss: float | torch.Tensor | None = None) -> bool:
        """Step `step` is done: report it (heartbeat, step, loss), save when a checkpoint is due
        (async), and agree with every rank whether the job was asked to stop. Returns True when
        it was: the checkpoint of `step` is then committed and the script leaves its loop and
        calls `finish`."""
        progress = self._progress
        now = time.monotonic()
        if progress.last_step_at is not None:
            progress.step_seconds = now - progress.last_step_at
            progress.productive_seconds += progress.step_seconds
        progress.last_step_at = now
        progress.step, progress.steps_this_attempt = step, progress.steps_this_attempt + 1
        if loss is not None:
            progress.loss = float(loss.detach().float().mean().item()
                                  if isinstance(loss, torch.Tensor) else loss)
        self.heartbeat()
        interval = self.cfg.interval_steps
        if self.state is not None and interval and step % interval == 0:
            self.save(step)
        self.checkpointer.poll()
        if self._agreement.should_stop(step, progress.steps_this_attempt):
            self._stop(step)
            return True
        return False

    def save(self, step: int, *, wait: bool = False, deadline: float | None = None) -> float:
        """Start an async checkpoint of `state` as step `step` (collective: every rank at the same
        step); `wait`: until it is committed. Returns the seconds the caller was blocked.
        `deadline`: a stop's (Checkpointer.save)."""
        if self.state is None:
            raise RuntimeError("rtj_trainer.lib: this run was started without a state to save")
        began = time.perf_counter()
        self.checkpointer.save(step, self._flat_state(step), deadline=deadline)
        self._progress.saved_step = step
        if wait:
            self.checkpointer.wait_until_committed()
        self._progress.stall_seconds = time.perf_counter() - began
        return self._progress.stall_seconds

    def finish(self) -> None:
        """The loop ended: save the last step unless it is saved, wait until every checkpoint is
        committed, write the pod's termination message, and release everything. After a stop
        (`step` returned True) the process exits here with the stop's exit code (0: this pod
        was asked to stop; 95: a peer was, and this worker's launcher restarts it)."""
        progress = self._progress
        STOP.disarm()
        if progress.stopped and not progress.stop_committed:
            self._stopped_without_checkpoint()
            return
        if (self.state is not None and not progress.stopped and self.cfg.save_final
                and progress.saved_step != progress.step and progress.step > self.start_step):
            self.save(progress.step)
        if not progress.stopped and progress.saved_step == progress.step:
            self.checkpointer.wait_until_kept(progress.step)  # the run's last save
        else:
            self.checkpointer.wait_until_committed()
        dist.barrier()
        stats = self.checkpointer.stats
        committed = stats.committed_step if stats.committed_step >= 0 else None
        if self._external is not None:
            committed = self._external[0]
        if progress.stopped:
            if STOP.requested:
                self._report(termination.TerminationMessage(
                    outcome=termination.STOPPED, step=progress.step, committed_step=committed,
                    committed_time=stats.committed_at or None,
                    checkpoint=str(stats.committed_dir) if stats.committed_dir else None,
                    reason="CheckpointedBeforeStop",
                    message=f"checkpointed step {committed} before stopping", exit_code=0))
            self.close()
            exit_now(stop_exit_code(STOP.requested))
        self._report(termination.TerminationMessage(
            outcome=termination.SUCCEEDED, step=progress.step, committed_step=committed,
            committed_time=stats.committed_at or None, reason="Completed",
            message=f"training reached step {progress.step}", exit_code=0))
        self.checkpointer.discard_local_copies()
        self.checkpointer.release_lock()  # the job is done: the directory is free
        self.close()

    def _stopped_without_checkpoint(self) -> None:
        """`finish` after a stop that gave up its checkpoint: no further wait and no collective
        (a peer may be gone), a termination message that claims no committed step, a writer
        still at it stopped, and the stop's exit."""
        progress, stats = self._progress, self.checkpointer.stats
        if STOP.requested:
            self._report(termination.TerminationMessage(
                outcome=termination.STOPPED, step=progress.step, reason=STOP_NOT_COMMITTED,
                message=(f"asked to stop after step {progress.step}, but its checkpoint was not "
                         "committed before the pod's termination budget ran out; the newest "
                         f"commit is step {stats.committed_step}"), exit_code=0))
        self.close(abort=True)
        exit_now(stop_exit_code(STOP.requested))

    def committed(self, step: int, directory: str | None = None) -> None:
        """A checkpoint the script wrote on its own (the library started with no state) is
        committed: report it as the job's newest (`status.lastCheckpoint`)."""
        self._external = (step, time.time(), directory)

    def close(self, *, abort: bool = False) -> None:
        """Release the writer (`abort`: stop it even in the middle of a write), the metrics
        endpoint and the rank-monitor connection."""
        self.metrics.unwatch()
        self.checkpointer.close(abort=abort)
        self.metrics.close()
        if self._client is not None and self._client.is_initialized:
            self._client.shutdown_workload_monitoring()

    def snapshot(self) -> Snapshot:
        """The metrics' values now (called on every scrape)."""
        progress, stats = self._progress, self.checkpointer.stats
        ledger = progress.ledger
        committed_step, committed_at = stats.committed_step, stats.committed_at
        if self._external is not None:
            committed_step, committed_at = self._external[0], self._external[1]
        return Snapshot(
            heartbeat_timestamp=progress.heartbeat, step=progress.step,
            step_seconds=progress.step_seconds,
            checkpoint_stall_seconds=progress.stall_seconds,
            checkpoint_write_seconds=stats.last_write_seconds,
            checkpoint_committed_step=committed_step,
            checkpoint_committed_timestamp=committed_at,
            restarts=dict(ledger.restarts) if ledger else {},
            productive_seconds=progress.productive_seconds,
            lost_seconds=ledger.lost_seconds if ledger else 0.0,
            job_started_at=ledger.started_at if ledger else time.time())

    # -- the checkpoint's content -----------------------------------------------------------------

    def _flat_state(self, step: int) -> dict[str, Any]:
        """`state` as plain data: modules and optimizers through torch's state-dict API (this
        rank's local slices), stateful objects through `state_dict()`, the rest as it is."""
        assert self.state is not None
        model, optimizers = _model_and_optimizers(self.state)
        flat: dict[str, Any] = {}
        if model is not None:
            model_sd, optim_sd = get_state_dict(self.state[model], optimizers or [])
            flat[model] = to_local(model_sd)
            slices = sharding(model_sd, model)
            for key in _keys_of(self.state, Optimizer):
                flat[key] = to_local(optim_sd) if optimizers else {}
                slices.update(sharding(optim_sd, key))
            flat[SHARDING] = slices
        for key, value in self.state.items():
            if key in flat:
                continue
            flat[key] = value.state_dict() if _stateful(value) else value
        flat[RESERVED] = {"step": step, "loss": self._progress.loss,
                          "productive_seconds": self._progress.productive_seconds,
                          "step_completed_at": time.time()}
        return flat

    def _load(self, saved: dict[str, Any]) -> None:
        assert self.state is not None
        model, optimizers = _model_and_optimizers(self.state)
        if model is not None:
            model_template, optim_template = get_state_dict(self.state[model], optimizers or [])
            optim_key = next(iter(_keys_of(self.state, Optimizer)), None)
            set_state_dict(
                self.state[model], optimizers or [],
                model_state_dict=into_template(model_template, saved[model], model),
                optim_state_dict=(into_template(optim_template, saved[optim_key], optim_key)
                                  if optim_key is not None else {}))
        for key, value in self.state.items():
            if key in (model, SHARDING) or isinstance(value, Optimizer):
                continue
            if key not in saved:
                raise ConfigError(f"checkpoint holds no {key!r}: the state saved had "
                                  f"{sorted(k for k in saved if k != RESERVED)}")
            # On CUDA the checkpoint's large tensors are read onto the device (format.read_shard)
            # for the model and optimizer; the script's own entries come back on the host, as
            # they did when every tensor was read from the file's map.
            entry = _on_host(saved[key])
            if _stateful(value):
                value.load_state_dict(entry)
            else:
                self.state[key] = entry

    def _resume(self) -> int:
        loaded = self.checkpointer.load_latest() if self.state is not None else None
        completed_at = None
        step = 0
        if loaded is not None:
            record = loaded.state.get(RESERVED, {})
            self._load(loaded.state)
            step = int(record.get("step", 0))
            self._progress.productive_seconds = float(record.get("productive_seconds", 0.0))
            self._progress.loss = float(record.get("loss", float("nan")))
            completed_at = record.get("step_completed_at")
            if self.rank == 0:
                log.info("resumed from %s (step %d)", loaded.directory.name, step)
        self._progress.step = step
        self._progress.ledger = _reconcile_ledger(self.job, self.launch.launcher_restart_count,
                                                  Path(self.cfg.dir), completed_at, step)
        self.heartbeat()
        return step

    def _stop(self, step: int) -> None:
        """Every rank agreed to stop after `step`: save it unless saved, wait for the commit,
        within the stop's budget (rtj_trainer.stop, as `Trainer.stop`); past it the stop goes on
        without its checkpoint (`stop_committed` False) and joins no further collective."""
        _, deadline = self._agreement.stop_deadline(self.cfg.stop_timeout_seconds)
        saves = self.state is not None and bool(self.cfg.interval_steps)
        try:
            if saves and self._progress.saved_step != step:
                self.save(step, deadline=deadline)
            committed = self.checkpointer.wait_for_stop(step if saves else None, deadline)
        except CommitTimeoutError as exc:
            log.error("the stop checkpoint of step %d could not be started in time (%s)", step,
                      exc)
            committed = False
        self._progress.stopped = True
        self._progress.stop_committed = committed
        if committed:
            self._progress.everyone_stopped = self._agreement.verdict().everyone
        if self._client is not None and self._client.is_initialized:
            # The rank monitor was signalled with the launcher: leave it before the way out.
            self._client.shutdown_workload_monitoring()

    def _report(self, message: termination.TerminationMessage) -> None:
        path = termination.configured_path()
        if path is not None and self.launch.local_rank == 0:
            try:
                termination.write(path, message)
            except OSError as exc:
                log.error("cannot write the termination message %s: %s", path, exc)


def init(state: dict[str, Any] | None, *, nvrx_heartbeats: bool = True) -> Run:
    """Start this worker's `Run` (see the module docstring); collective: every rank calls it,
    after `init_process_group`. `state=None`: the script checkpoints on its own (report its saves
    with `Run.committed`). `nvrx_heartbeats=False`: the script sends its own NVRx heartbeats
    (the library then leaves the rank monitor alone)."""
    tree = environment_overrides(os.environ)
    return Run(state, checkpoint=CheckpointConfig(**tree.get("checkpoint", {})),
               job=JobConfig(**tree.get("job", {})),
               metrics=MetricsConfig(**tree.get("metrics", {})), nvrx_heartbeats=nvrx_heartbeats)


# -- helpers ------------------------------------------------------------------------------------


def _on_host(tree: Any) -> Any:
    """`tree` (dicts, lists and tuples of tensors and plain data) with every tensor not on the
    CPU copied there; the rest as it is."""
    return map_leaves(tree, torch.Tensor, lambda t: t if t.device.type == "cpu" else t.cpu())


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


def _keys_of(state: dict[str, Any], kind: type) -> list[str]:
    return [key for key, value in state.items() if isinstance(value, kind)]


def _model_and_optimizers(state: dict[str, Any]) -> tuple[str | None, list[Optimizer]]:
    modules = _keys_of(state, torch.nn.Module)
    optimizers = [state[key] for key in _keys_of(state, Optimizer)]
    if len(modules) > 1 and optimizers:
        raise ConfigError(f"rtj_trainer.lib: state holds the modules {modules} and optimizers: "
                          "name one module (the one the optimizers train); keep others out")
    return (modules[0] if modules else None), optimizers


def _check_state(state: dict[str, Any]) -> None:
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise ConfigError("rtj_trainer.lib.init: state must be a dict with string keys")
    for key in (RESERVED, SHARDING):
        if key in state:
            raise ConfigError(f"rtj_trainer.lib.init: the key {key!r} is the library's own")
    if len(_keys_of(state, Optimizer)) > 1:
        raise ConfigError("rtj_trainer.lib.init: state holds more than one optimizer; put one "
                          "(torch's state-dict API takes one per module)")
    _model_and_optimizers(state)


def _agree_on_identity(job: JobConfig, launcher_restart_count: int) -> str:
    """Rank 0 names this attempt (checkpoint directories carry the name)."""
    name = [f"a{job.attempt}-l{launcher_restart_count}-i0-{int(time.time() * 1000) % 10**8}"]
    dist.broadcast_object_list(name, src=0)
    return str(name[0])


def _reconcile_ledger(job: JobConfig, launcher_restart_count: int, root: Path,
                      completed_at: float | None, step: int) -> Ledger:
    """Rank 0 advances the job ledger (restarts by kind, lost seconds: rtj_trainer.ledger);
    every rank gets the same ledger."""
    attempts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(attempts, (str(job.node_index), job.attempt))
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        ledger = advance_ledger(Ledger.read(root / LEDGER_FILE), now=time.time(),
                                pod_attempts=dict(attempts),
                                launcher_restart_count=launcher_restart_count,
                                inprocess_iteration=0, resumed_step_completed_at=completed_at,
                                resumed_step=step or None)
        ledger.write(root / LEDGER_FILE)
        box[0] = ledger
    dist.broadcast_object_list(box, src=0)
    result: Ledger = box[0]
    return result
