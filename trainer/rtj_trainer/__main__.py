"""`python -m rtj_trainer [--config FILE] [--preset NAME] [--set key=value]...`

Run one trainer worker (normally under `ft_launcher`, which starts one per local rank). Rank 0
prints the summary JSON line as the last line of its output; the exit code is 0 only when the job
reached its last step.

Progress goes through one logger, `rtj_trainer`, set up here: its lines go to stdout as
`[rtj-trainer] ...` (or `[rtj-trainer rank N] ...` for lines every rank writes, logged with
`extra={"rank": N}`). Tests and benchmarks parse some of them (`resumed from ...`, `checkpoint
step ... stall ... s`, `injecting fault ...`), so their text is a contract. Progress is INFO and
always shown; `train.log_level` (RTJ_LOG_LEVEL) sets the level of everything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .config import PRESETS, ConfigError, build_config, launch_environment

log = logging.getLogger("rtj_trainer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rtj_trainer", description=__doc__)
    parser.add_argument("--config", help="YAML or JSON file with config sections")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="named model/run size (default: the file's 'preset' or tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override one field, e.g. train.steps=20")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as JSON and exit")
    return parser.parse_args(argv)


class _PrefixFormatter(logging.Formatter):
    """`[rtj-trainer] message`, `[rtj-trainer rank N] message`; other levels than INFO are named."""

    def format(self, record: logging.LogRecord) -> str:
        rank = getattr(record, "rank", None)
        prefix = "[rtj-trainer]" if rank is None else f"[rtj-trainer rank {rank}]"
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno == logging.INFO:
            return f"{prefix} {message}"
        return f"{prefix} {record.levelname} {record.name}: {message}"


def setup_logging(level: str) -> None:
    """Other libraries (NVRx, torch) log to stderr at `level`, as before; the trainer's own
    logger writes its prefixed lines to stdout, at INFO or below (progress is always shown)."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_PrefixFormatter())
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(min(logging.INFO, logging.getLevelName(level)))


def main(argv: list[str] | None = None) -> int:
    from . import timeline

    started = timeline.process_start_time()
    if started is not None:
        timeline.mark("process_start", started)
    timeline.mark("main")
    args = parse_args(argv)
    try:
        cfg = build_config(preset=args.preset or ("tiny" if args.config is None else None),
                           file=args.config, overrides=args.overrides)
    except ConfigError as exc:
        print(f"rtj_trainer: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.model_dump(), indent=1))
        return 0
    setup_logging(cfg.train.log_level)
    if cfg.train.dump_stacks_on_sigterm:
        import faulthandler
        import signal

        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    # Heavy imports only after the config is known to be valid.
    from .metrics import TrainerMetrics
    from .resiliency import Resiliency, waiting_as_spare
    from .train import train

    timeline.mark("imports")
    launch = launch_environment()
    metrics = TrainerMetrics(rank=launch.rank, local_rank=launch.local_rank, job=cfg.job.name,
                             attempt=cfg.job.attempt)
    metrics.standby = waiting_as_spare
    if cfg.metrics.port is not None:
        port = metrics.serve(cfg.metrics.host, cfg.metrics.port)
        log.info("metrics on http://%s:%d/metrics", cfg.metrics.host, port,
                 extra={"rank": launch.rank})
    resiliency = Resiliency(cfg, launch)
    try:
        summary = resiliency.run(lambda session: train(cfg, session, metrics))
    finally:
        resiliency.close()
        metrics.close()
    if summary is not None:
        print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
