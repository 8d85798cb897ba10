"""FSDP trainer with NVIDIA Resiliency Extension: heartbeats, async checkpoints,
in-process restart, metrics and fault injection."""

import os as _os

# torch's C++ warnings are off unless a job asks for them (TORCH_CPP_LOG_LEVEL=WARNING in its
# env): c10d writes two warning lines each time a store wait times out, and NVRx's in-process
# monitor thread waits on its store in 0.5 s waits for the whole run, so they made up some 85 %
# of a pod's log (about four lines a second per rank). torch reads the variable when it is first
# imported, hence here, before any module of the trainer imports it; every process of the
# trainer (launcher shim, warm workers, ranks) imports this package first, so they all agree
# (the warm pool refuses a worker whose value differs: rtj_trainer.warm.wire).
_os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
