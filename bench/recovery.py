"""Recovery time of the tiny CPU trainer after one injected fault, without Kubernetes.

Each run starts `trainer/scripts/train-local.sh` (2 gloo ranks under NVRx ft_launcher) in a fresh
directory with one fault (`TRAINER_FAULTS=STEP:RANK:KIND`) and measures the seconds from the fault
firing (the trainer's fault marker timestamp) to the first completed step after recovery, split
into detect / restart / init / load / first step where the logs show the milestones (see
bench/localrun.py). Scenarios:

- `exception-inprocess`: a Python exception with in-process restart on (NVRx `inprocess.Wrapper`
  re-enters the training function in the same processes). It runs with its own, longer heartbeat
  timeout (`--inprocess-heartbeat-timeout`, 15 s): before the restart cut the attempt's gloo
  connections (rtj_trainer.gloocut) the surviving rank sat in a gloo collective until gloo's 5 s
  timeout, and a rank-monitor heartbeat timeout at or below that killed the workers first,
  turning it into a launcher restart; the longer timeout is kept so that runs compare;
- `exception-launcher`: the same exception with in-process restart off (ft_launcher restarts the
  worker group);
- `sigkill`: the rank's process is SIGKILLed (ft_launcher notices the dead worker);
- `hang`: the rank stops making progress (NVRx rank monitor misses heartbeats).

The restart kind the trainer actually counted (`summary.restarts`) is reported next to each
scenario, so a scenario that fell back to another mechanism shows it.

    python -m bench.recovery --repeats 3 --out results/recovery.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import (
    add_local_run_arguments,
    describe_spread,
    format_spread,
    format_table,
    machine_description,
    write_json,
)
from .localrun import PHASES, LocalRun, run_local_trainer


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    kind: str
    inprocess: bool
    what: str
    own_heartbeat_timeout: bool = False
    """Runs with --inprocess-heartbeat-timeout instead of --heartbeat-timeout."""


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("exception-inprocess", "exception", True,
                 "exception, in-process restart on (NVRx Wrapper)", own_heartbeat_timeout=True),
        Scenario("exception-launcher", "exception", False,
                 "exception, in-process restart off (ft_launcher restart)"),
        Scenario("sigkill", "sigkill", False, "SIGKILL of one rank (ft_launcher restart)"),
        Scenario("hang", "hang", False, "hang of one rank (heartbeat timeout, then restart)"),
    )
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.recovery", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per scenario (default 3)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of: {', '.join(SCENARIOS)}")
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    parser.add_argument("--fault-step", type=int, default=13,
                        help="step at whose start the fault fires (default 13)")
    parser.add_argument("--fault-rank", type=int, default=1, help="global rank hit (default 1)")
    parser.add_argument("--checkpoint-interval", type=int, default=5,
                        help="checkpoint every N steps (default 5)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="ft_launcher rank heartbeat timeout, seconds (default 5)")
    parser.add_argument("--inprocess-heartbeat-timeout", type=float, default=15.0,
                        help="heartbeat timeout of the in-process scenario (default 15): it must "
                             "exceed the 5 s gloo timeout a surviving rank could wait out on CPU "
                             "before the restart cut gloo's connections (rtj_trainer.gloocut)")
    add_local_run_arguments(parser, run_timeout=300.0)
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios.split(",") if s and s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    if not 1 <= args.fault_step <= args.steps:
        parser.error("--fault-step must be between 1 and --steps")
    return args


def aggregate(runs: list[LocalRun]) -> dict[str, Any]:
    """Spread of each phase and of the totals over the runs' (first) recoveries."""
    recoveries = [run.recoveries() for run in runs]
    firsts = [r[0] for r in recoveries if r]
    restart_kinds = []
    for run in runs:
        counts = (run.summary or {}).get("restarts") or {}
        seen = [f"{kind}x{n}" if n > 1 else kind for kind, n in counts.items() if n]
        restart_kinds.append("+".join(seen) if seen else ("none" if run.summary else "no summary"))
    return {
        "phases": {name: describe_spread(r.phases.get(name) for r in firsts)
                   for name, _ in PHASES},
        "total_seconds": describe_spread(r.total_seconds for r in firsts),
        "back_to_fault_step_seconds": describe_spread(r.back_to_fault_step_seconds
                                                      for r in firsts),
        "restart_kinds": restart_kinds,
        "completed_runs": sum(1 for run in runs if run.summary is not None),
        "runs": len(runs),
    }


def render(results: dict[str, Any]) -> str:
    header = ["scenario", "hb timeout", "restart counted", *[name for name, _ in PHASES],
              "fault → next step", "fault → faulted step done", "ok"]
    rows = []
    for name, data in results["scenarios"].items():
        agg = data["aggregate"]
        kinds = sorted(set(agg["restart_kinds"]))
        rows.append([
            name, f"{data['heartbeat_timeout_seconds']:g} s", ", ".join(kinds),
            *[format_spread(agg["phases"][phase]) for phase, _ in PHASES],
            format_spread(agg["total_seconds"]), format_spread(agg["back_to_fault_step_seconds"]),
            f"{agg['completed_runs']}/{agg['runs']}",
        ])
    lines = [
        "Recovery after one fault (seconds; median (min-max) over runs):",
        "",
        format_table(header, rows),
        "",
        "Phases: " + "; ".join(f"{name} = {what}" for name, what in PHASES) + ".",
        f"Cold start (launcher start → first step), all runs: "
        f"{format_spread(results['cold_start_seconds'])} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-recovery."))
    work_dir.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.scenarios.split(",") if s]
    sets = [f"train.steps={args.steps}", f"checkpoint.interval_steps={args.checkpoint_interval}",
            "train.log_every=1000000", *args.sets]
    results: dict[str, Any] = {
        "benchmark": "recovery",
        "command": "python -m bench.recovery " + shlex.join(argv if argv is not None
                                                            else sys.argv[1:]),
        "machine": machine_description(),
        "settings": {"repeats": args.repeats, "steps": args.steps, "fault_step": args.fault_step,
                     "fault_rank": args.fault_rank,
                     "checkpoint_interval": args.checkpoint_interval,
                     "heartbeat_timeout_seconds": args.heartbeat_timeout,
                     "inprocess_heartbeat_timeout_seconds": args.inprocess_heartbeat_timeout,
                     "sets": sets,
                     "work_dir": str(work_dir)},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "scenarios": {},
    }
    all_runs: list[LocalRun] = []
    for name in names:
        scenario = SCENARIOS[name]
        heartbeat = (args.inprocess_heartbeat_timeout if scenario.own_heartbeat_timeout
                     else args.heartbeat_timeout)
        runs = []
        for repeat in range(args.repeats):
            run = run_local_trainer(
                work_dir / f"{name}-{repeat}",
                faults=f"{args.fault_step}:{args.fault_rank}:{scenario.kind}",
                sets=sets,
                inprocess=scenario.inprocess,
                heartbeat_timeout_seconds=heartbeat,
                timeout_seconds=args.run_timeout,
            )
            recoveries = run.recoveries()
            total = recoveries[0].total_seconds if recoveries else None
            print(f"[bench.recovery] {name} #{repeat}: rc={run.rc} "
                  f"fault→next step={total} s restarts={(run.summary or {}).get('restarts')} "
                  f"log={run.log_path}"
                  + (" WARNING: trainer sources changed during the run"
                     if run.trainer_source_changed else ""), flush=True)
            runs.append(run)
        all_runs.extend(runs)
        results["scenarios"][name] = {
            "what": scenario.what,
            "heartbeat_timeout_seconds": heartbeat,
            "aggregate": aggregate(runs),
            "runs": [run.as_dict() for run in runs],
        }
    results["cold_start_seconds"] = describe_spread(r.cold_start_seconds() for r in all_runs)
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(args.out, results)
    print(render(results))
    if args.out:
        print(f"\nJSON: {args.out}")
    return 0 if all(s["aggregate"]["completed_runs"] == s["aggregate"]["runs"]
                    for s in results["scenarios"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
