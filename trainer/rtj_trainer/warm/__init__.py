"""Warm workers: processes that did a worker's heavy imports before ft_launcher asks for one.

Imported by two kinds of process, never by the launcher shim's own code path beyond `wire`: the
attach client (`python -m rtj_trainer.warm.attach`, the worker command ft_launcher starts when
warm workers are on; it must start in tens of milliseconds, so it imports `wire` and the standard
library only) and the warm worker (`python -m rtj_trainer.warm.worker`, started by the shim's pool,
rtj_trainer.launcher.warmpool), which preloads torch, NVRx and the worker's modules by name and
then runs `python -m rtj_trainer` in place. `wire` is what the three agree on.
"""
