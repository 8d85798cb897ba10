"""What a trainer pod reserves: ports, exit codes and signals (docs/byo.md states them for a
team's own script)."""

from __future__ import annotations

import signal
from typing import Final

DEFAULT_METRICS_PORT: Final = 9400
"""The operator's default base port (`spec.monitoring.metricsPort`): local rank r serves its
Prometheus page on base + r."""


def pod_endpoint_port(metrics_port: int) -> int:
    """The launcher shim's pod endpoint (`GET /ranks`, `POST /lost-pods`): one below the first
    rank's port; 0 (off) for a base port of 1 or less."""
    return metrics_port - 1 if metrics_port > 1 else 0


FATAL_EXIT_CODE: Final = 94
"""A worker that exits with this code says restarting cannot help (a bad configuration, data of
another job): the launcher shim stops every launcher of the job and the operator fails it."""
PEER_STOPPED_EXIT_CODE: Final = 95
"""A worker that stopped (after a checkpoint) because a peer pod was asked to stop: its launcher
restarts it without spending a restart."""
NO_RESTART_EXIT_CODE: Final = 93
"""ft_launcher's own exit code when a job must not be restarted (`--ft-no-restart-exit-code`)."""
RESERVED_EXIT_CODES: Final = frozenset({NO_RESTART_EXIT_CODE, FATAL_EXIT_CODE,
                                        PEER_STOPPED_EXIT_CODE})

CHECKPOINT_AND_STOP_SIGNAL: Final = signal.SIGUSR2
"""What asks a worker that opted in (rtj_trainer's own worker, or a script using the trainer's
public library) to commit a checkpoint of its current step and exit. Every other worker gets the
torchrun convention: SIGTERM, then SIGKILL after the launcher's `--term-timeout`."""
