"""`python -m rtj_trainer [--config FILE] [--preset NAME] [--set key=value]...`

Run one trainer worker (normally under `ft_launcher`, which starts one per local rank). Rank 0
prints the summary JSON line as the last line of its output; the exit code is 0 only when the job
reached its last step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .config import PRESETS, ConfigError, build_config, launch_environment
from .faults import FaultSpecError, parse_faults


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = build_config(preset=args.preset or ("tiny" if args.config is None else None),
                           file=args.config, overrides=args.overrides)
        parse_faults(cfg.faults)
    except (ConfigError, FaultSpecError) as exc:
        print(f"rtj_trainer: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.model_dump(), indent=1))
        return 0
    logging.basicConfig(
        level=os.environ.get("RTJ_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    # Heavy imports only after the config is known to be valid.
    from .metrics import TrainerMetrics
    from .resiliency import Resiliency
    from .train import train

    launch = launch_environment()
    metrics = TrainerMetrics(rank=launch.rank, local_rank=launch.local_rank, job=cfg.job.name,
                             attempt=cfg.job.attempt)
    if cfg.metrics.port is not None:
        port = metrics.serve(cfg.metrics.host, cfg.metrics.port)
        print(f"[rtj-trainer rank {launch.rank}] metrics on http://{cfg.metrics.host}:{port}/metrics",
              flush=True)
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
