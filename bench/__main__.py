"""`python -m bench` (`make bench`): the CPU recovery and goodput benchmarks with modest defaults.

Runs `bench.recovery` (every scenario, `--repeats` times) and then `bench.goodput` (the faulted,
fault-free and synchronous-checkpoint runs), writing `<out-dir>/recovery.json` and
`<out-dir>/goodput.json` and printing both tables. About 17 minutes with the defaults on the
2-core development machine (measured while other tests ran; docs/benchmarks.md). Kubernetes
recovery is separate: `python -m bench.operator_recovery`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import goodput, recovery


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path,
                        default=Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"),
                        help="where recovery.json and goodput.json go "
                             "(default bench-results/<timestamp>)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="recovery runs per scenario (default 3)")
    parser.add_argument("--steps", type=int, default=2000, help="goodput run length (default 2000)")
    parser.add_argument("--only", choices=("recovery", "goodput"), default=None,
                        help="run just one of the two")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    status = 0
    if args.only in (None, "recovery"):
        status |= recovery.main(["--repeats", str(args.repeats),
                                 "--work-dir", str(args.out_dir / "recovery-runs"),
                                 "--out", str(args.out_dir / "recovery.json")])
        print()
    if args.only in (None, "goodput"):
        status |= goodput.main(["--steps", str(args.steps),
                                "--work-dir", str(args.out_dir / "goodput-runs"),
                                "--out", str(args.out_dir / "goodput.json")])
    return status


if __name__ == "__main__":
    sys.exit(main())
