"""Variable names on the operator → pod → worker path (docs/design.md, "The pod's environment").

The operator sets the first group on every trainer container (rtj_operator.builders); the
trainer reads them in one place (rtj_trainer.config) and a script a team brings may read them
too (docs/byo.md). The launcher shim sets the second group for its workers.
"""

from __future__ import annotations

from typing import Final

# Identity and topology (set by the operator).
JOB_NAME: Final = "RTJ_JOB_NAME"
JOB_UID: Final = "RTJ_JOB_UID"
POD_NAMESPACE: Final = "POD_NAMESPACE"
POD_NAME: Final = "POD_NAME"
POD_UID: Final = "POD_UID"
POD_IP: Final = "POD_IP"
NODE_INDEX: Final = "RTJ_NODE_INDEX"
NNODES: Final = "RTJ_NNODES"
PROCS_PER_NODE: Final = "RTJ_PROCS_PER_NODE"
ATTEMPT: Final = "RTJ_ATTEMPT"
"""The pod's attempt number: how many times the operator recreated this node index's pod."""

# Checkpoints (set by the operator from spec.checkpoint).
CHECKPOINT_DIR: Final = "RTJ_CHECKPOINT_DIR"
CHECKPOINT_INTERVAL_STEPS: Final = "RTJ_CHECKPOINT_INTERVAL_STEPS"
CHECKPOINT_KEEP: Final = "RTJ_CHECKPOINT_KEEP"
CHECKPOINT_MODE: Final = "RTJ_CHECKPOINT_MODE"
CHECKPOINT_RESUME_FROM_JOBS: Final = "RTJ_CHECKPOINT_RESUME_FROM_JOBS"

# Metrics, liveness and the pod's end (set by the operator).
METRICS_HOST: Final = "RTJ_METRICS_HOST"
METRICS_PORT: Final = "RTJ_METRICS_PORT"
"""Local rank r serves its Prometheus page on METRICS_PORT + r; the pod endpoint is one below."""
TERMINATION_MESSAGE_PATH: Final = "RTJ_TERMINATION_MESSAGE_PATH"
HEARTBEAT_TIMEOUT_SECONDS: Final = "RTJ_HEARTBEAT_TIMEOUT_SECONDS"

# Resiliency (set by the operator from spec.faultTolerance).
INPROCESS_RESTART: Final = "RTJ_INPROCESS_RESTART"
SPARE_NODES: Final = "RTJ_SPARE_NODES"
WARM_WORKERS: Final = "RTJ_WARM_WORKERS"
DEVICE_KEEPER: Final = "RTJ_DEVICE_KEEPER"
FAULT_INJECTION: Final = "RTJ_FAULT_INJECTION"
TRAINER_FAULTS: Final = "TRAINER_FAULTS"
LOG_LEVEL: Final = "RTJ_LOG_LEVEL"

# Set by the launcher shim for its workers.
LOST_PODS_FILE: Final = "RTJ_LOST_PODS_FILE"
"""The pod-local file of the operator's verdicts on lost peer pods (rtj_wire.lostpods)."""
WARM_POOL_DIR: Final = "RTJ_WARM_POOL_DIR"
STOP_SIGNAL_DIR: Final = "RTJ_STOP_SIGNAL_DIR"
"""Where a worker that handles the checkpoint-and-stop signal (rtj_wire.pod) says so: a file named
`local-rank-<r>` (rtj_trainer.stop.register). The shim sends that signal to those workers only;
every other worker gets the torchrun convention (SIGTERM, then SIGKILL after the grace)."""
