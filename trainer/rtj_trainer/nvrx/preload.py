"""The NVRx modules a training worker imports, imported here: what a warm worker preloads
(rtj_trainer.warm.worker) so that a worker it takes over starts without these imports."""

import nvidia_resiliency_ext.checkpointing.async_ckpt.core
import nvidia_resiliency_ext.fault_tolerance
import nvidia_resiliency_ext.inprocess  # noqa: F401
