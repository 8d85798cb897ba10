"""The ft_launcher settings every trainer runs under, in one place: the operator's pods
(`launcher.trainer_argv`) and the local runs the benchmarks measure
(`trainer/scripts/train-local.sh`, through `python -m rtj_operator.ftflags`) get the same flags
from the same function, so a benchmark measures what a pod does.

Imports nothing from the operator (the shell script calls it where neither kopf nor the
Kubernetes client is installed).

Why these values (NVRx 0.7.0; docs/nvrx.md):

- `--ft-workload-check-interval=1`: how often the rank monitor compares heartbeats against their
  timeout (NVRx default 5 s). Detection of a hang is timeout + up to one interval.
- `--monitor-interval=0.3`: how often the launcher polls its workers (a dead worker is noticed
  within it).
- `--workers-stop-timeout=5`: SIGTERM → SIGKILL when the launcher stops its workers to restart
  them (NVRx default 15 s). Nothing a worker does after SIGTERM is needed for correctness:
  checkpoints commit atomically, and an interrupted write is never committed.
- `--max-restarts`: a launcher spends one restart on *every* fault of the job, including faults
  of other pods (any-failed policy: every launcher restarts its workers) and the faults the
  operator answers with a RankRestart. So each launcher gets its own in-pod budget plus the
  job's rank-restart budget; the operator's windowed budgets, not a launcher's lifetime count,
  decide when the job escalates.
- `--ft-gpu-memory-poll-interval=0.1` (GPU jobs): after stopping its workers the launcher waits
  until NVML shows the GPUs' memory freed, polling every 2 s by default; the first poll usually
  still sees the exiting workers, so every launcher restart paid 2 s for nothing.
- No `--ft-checkpoint-iteration-file`: NVRx's no-progress tracker would exit 93 after three
  restarts without a new checkpoint, ending a job that crashes before its first checkpoint
  outside the operator's ladder. The operator's progress timeout covers the same ground.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

WORKLOAD_CHECK_INTERVAL_SECONDS = 1.0
MONITOR_INTERVAL_SECONDS = 0.3
WORKERS_STOP_TIMEOUT_SECONDS = 5
GPU_MEMORY_RECLAIM_TIMEOUT_SECONDS = 50
"""ft_launcher's default wait for GPU memory to be freed between worker restarts."""
GPU_MEMORY_POLL_INTERVAL_SECONDS = 0.1
"""How often ft_launcher reads NVML during that wait (NVRx default 2 s: the freed memory was
seen 2 s after the workers exited in every launcher restart on an H200, docs/benchmarks.md)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LauncherSettings:
    """What the flags are derived from (a job's spec and pod plan, or a local run's options)."""

    max_restarts: int
    term_timeout_seconds: int
    initial_heartbeat_timeout_seconds: float
    heartbeat_timeout_seconds: float
    gpus: int


def _number(value: float) -> str:
    return f"{value:g}"


def ft_flags(s: LauncherSettings) -> list[str]:
    """ft_launcher's restart, heartbeat and timing flags (not the rendezvous or the command)."""
    reclaim = GPU_MEMORY_RECLAIM_TIMEOUT_SECONDS if s.gpus else 0
    return [
        f"--max-restarts={s.max_restarts}",
        f"--term-timeout={s.term_timeout_seconds}",
        f"--workers-stop-timeout={WORKERS_STOP_TIMEOUT_SECONDS}",
        f"--monitor-interval={_number(MONITOR_INTERVAL_SECONDS)}",
        # NVRx 0.7.0 has no default heartbeat timeouts: nothing is detected unless set.
        f"--ft-initial-rank-heartbeat-timeout={_number(s.initial_heartbeat_timeout_seconds)}",
        f"--ft-rank-heartbeat-timeout={_number(s.heartbeat_timeout_seconds)}",
        f"--ft-workload-check-interval={_number(WORKLOAD_CHECK_INTERVAL_SECONDS)}",
        # Without GPUs there is no memory to wait for (and no NVML to ask).
        f"--ft-gpu-memory-reclaim-timeout={reclaim}",
        *([f"--ft-gpu-memory-poll-interval={_number(GPU_MEMORY_POLL_INTERVAL_SECONDS)}"]
          if reclaim else []),
    ]


def main(argv: list[str] | None = None) -> int:
    """Print the flags one per line (for `mapfile` in trainer/scripts/train-local.sh)."""
    parser = argparse.ArgumentParser(prog="python -m rtj_operator.ftflags",
                                     description=ft_flags.__doc__)
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--term-timeout", type=int, required=True)
    parser.add_argument("--initial-heartbeat-timeout", type=float, required=True)
    parser.add_argument("--heartbeat-timeout", type=float, required=True)
    parser.add_argument("--gpus", type=int, required=True)
    args = parser.parse_args(argv)
    for flag in ft_flags(LauncherSettings(
        max_restarts=args.max_restarts,
        term_timeout_seconds=args.term_timeout,
        initial_heartbeat_timeout_seconds=args.initial_heartbeat_timeout,
        heartbeat_timeout_seconds=args.heartbeat_timeout,
        gpus=args.gpus,
    )):
        print(flag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
