"""Goodput of a 2,000-step CPU run with five injected faults, next to the same run without faults
and (cheap on CPU) the same fault-free run with synchronous checkpoints.

Goodput = productive seconds / wall seconds, as the trainer's summary reports it: productive
seconds are the wall seconds of the steps that were kept (recomputed steps count once), wall
seconds run from the job's first attempt start (after the first process group and model were
built) to the summary. The end-to-end figure also counts the cold start: productive seconds /
(launcher start -> summary).

Checkpoint efficiency of a fault-free run = (step-loop seconds - checkpoint stall seconds) /
step-loop seconds: the share of the loop not blocked by checkpointing (the seed's "async
checkpointing 99 % efficient").

`baseline` (issue #32): what a Kubeflow PyTorchJob user runs instead, same model, data, steps,
checkpoint interval and fault schedule, in the same run: `torchrun --max-restarts` over
bench/baseline_trainer.py (torch.distributed.checkpoint async saves; hang protection: the
collective timeout, `--baseline-collective-timeout`, PyTorch's NCCL default 600 s). A run that
does not finish within `--run-timeout` (a hang with one rank never recovers) is reported as not
completed. With it and a run of ours, the JSON has `ratio`: our goodput / the baseline's.

    python -m bench.goodput --out results/goodput.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import add_local_run_arguments, format_table, machine_description, write_json
from .localrun import LocalRun, run_local_trainer

DEFAULT_FAULTS = "330:1:exception,740:0:sigkill,1130:1:hang,1560:0:exception,1870:1:sigkill"
VARIANTS = ("faulted", "clean", "sync", "faulted-inprocess", "baseline")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.goodput", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="steps per run (default 2000)")
    parser.add_argument("--faults", default=DEFAULT_FAULTS,
                        help=f"TRAINER_FAULTS of the faulted runs (default {DEFAULT_FAULTS})")
    parser.add_argument("--checkpoint-interval", type=int, default=50,
                        help="checkpoint every N steps (default 50)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="ft_launcher rank heartbeat timeout, seconds (default 5)")
    parser.add_argument("--variants", default="faulted,clean,sync",
                        help=f"comma-separated subset of: {', '.join(VARIANTS)} "
                             "(default faulted,clean,sync)")
    parser.add_argument("--baseline-collective-timeout", type=float, default=600.0,
                        help="baseline: init_process_group timeout, seconds (default 600)")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each run's checkpoints and node-local copies (default: "
                             "deleted once its figures are taken, so the next run has the disk)")
    add_local_run_arguments(parser, run_timeout=1200.0)
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}")
    return args


CHECKPOINT_DIRS = ("step-*", "dcp-step-*")
"""A run's saves in its checkpoint directory: the trainer's and the baseline's."""


def free_checkpoints(run_dir: Path, sets: list[str]) -> int:
    """Delete a finished run's saves (`CHECKPOINT_DIRS` in `run_dir`) and its node-local copies
    (`checkpoint.local_dir` of `sets`); the next variant of the same invocation needs the disk:
    on a 64 GB machine the baseline's saves of an 11 GB state failed with ENOSPC beside ours
    (2026-12-06). The step log, the fault markers and the log file stay. Returns the bytes."""
    doomed = [path for pattern in CHECKPOINT_DIRS for path in run_dir.glob(pattern)
              if path.is_dir()]
    doomed += [Path(value) for key, _, value in (item.partition("=") for item in sets)
               if key == "checkpoint.local_dir" and value and Path(value).is_dir()]
    freed = 0
    for path in doomed:
        freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
    return freed


def run_figures(run: LocalRun) -> dict[str, Any]:
    """The numbers the table shows for one run."""
    summary = run.summary or {}
    figures: dict[str, Any] = {"completed": run.summary is not None, "rc": run.rc}
    if not summary:
        return figures
    productive = float(summary["productive_seconds"])
    wall = float(summary["wall_seconds"])
    end_to_end = (run.summary_at - run.started_at) if run.summary_at else None
    recoveries = [r for r in run.recoveries() if r.total_seconds is not None]
    figures.update(
        wall_seconds=wall,
        productive_seconds=productive,
        goodput=summary.get("goodput"),
        end_to_end_seconds=round(end_to_end, 3) if end_to_end else None,
        end_to_end_goodput=round(productive / end_to_end, 4) if end_to_end else None,
        restarts=summary.get("restarts"),
        lost_seconds=summary.get("lost_seconds"),
        faults_fired=len(run.fault_times),
        recovery_seconds=[r.total_seconds for r in recoveries],
        mean_step_ms=round(1000 * productive / max(1, int(summary["steps"])), 2),
        checkpoints_committed=summary.get("checkpoints_committed"),
    )
    loop = summary.get("attempt_loop_seconds")
    stall = summary.get("attempt_checkpoint_stall_seconds_total")
    if loop and stall is not None and not run.fault_times:
        figures["checkpoint_stall_seconds_total"] = stall
        figures["checkpoint_stall_seconds_max"] = summary.get(
            "attempt_checkpoint_stall_seconds_max")
        figures["step_loop_seconds"] = loop
        figures["checkpoint_efficiency"] = round((loop - stall) / loop, 4)
    return figures


def goodput_ratio(runs: dict[str, Any]) -> dict[str, Any] | None:
    """Our faulted run's goodput over the baseline's (same faults, same run), when both ran;
    a baseline that never finished has no goodput: the ratio is then None, and says why."""
    ours_name = next((n for n in ("faulted-inprocess", "faulted") if n in runs), None)
    if ours_name is None or "baseline" not in runs:
        return None
    ours = runs[ours_name]["figures"].get("goodput")
    theirs = runs["baseline"]["figures"].get("goodput")
    ratio = round(ours / theirs, 3) if ours and theirs else None
    why = None if ratio is not None else (
        "the baseline did not finish within --run-timeout" if not theirs else
        f"{ours_name} did not finish")
    return {"ours": ours_name, "ours_goodput": ours, "baseline_goodput": theirs, "ratio": ratio,
            "why_none": why}


def render(results: dict[str, Any]) -> str:
    def pct(value: Any) -> str:
        return f"{100 * value:.1f} %" if isinstance(value, (int, float)) else "-"

    def num(value: Any, digits: int = 1) -> str:
        return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"

    header = ["run", "wall s", "productive s", "goodput", "end-to-end s", "goodput e2e",
              "restarts", "recoveries s", "ms/step", "ckpt stall s", "ckpt efficiency"]
    rows = []
    for name, data in results["runs"].items():
        f = data["figures"]
        restarts = f.get("restarts") or {}
        rows.append([
            name, num(f.get("wall_seconds")), num(f.get("productive_seconds")),
            pct(f.get("goodput")), num(f.get("end_to_end_seconds")),
            pct(f.get("end_to_end_goodput")),
            ", ".join(f"{k} {v}" for k, v in restarts.items() if v) or "0",
            " ".join(num(s) for s in f.get("recovery_seconds", [])) or "-",
            num(f.get("mean_step_ms")),
            num(f.get("checkpoint_stall_seconds_total"), 2),
            pct(f.get("checkpoint_efficiency")),
        ])
    settings = results["settings"]
    return "\n".join([
        f"Goodput, {settings['steps']} steps, checkpoint every "
        f"{settings['checkpoint_interval']} steps (faulted runs: {settings['faults']}):",
        "",
        format_table(header, rows),
        *([] if not results.get("ratio") else [
            "", f"Goodput ratio {results['ratio']['ours']} / baseline: "
                f"{results['ratio']['ratio'] or results['ratio']['why_none']}"]),
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-goodput."))
    work_dir.mkdir(parents=True, exist_ok=True)
    base_sets = [f"train.steps={args.steps}",
                 f"checkpoint.interval_steps={args.checkpoint_interval}",
                 "train.log_every=100", *args.sets]
    plans: dict[str, dict[str, Any]] = {
        "faulted": {"faults": args.faults, "sets": base_sets, "inprocess": False},
        "faulted-inprocess": {"faults": args.faults, "sets": base_sets, "inprocess": True},
        "clean": {"faults": "", "sets": base_sets, "inprocess": False},
        "sync": {"faults": "", "sets": [*base_sets, "checkpoint.mode=sync"], "inprocess": False},
        "baseline": {"faults": args.faults, "sets": base_sets, "inprocess": False,
                     "baseline": True},
    }
    results: dict[str, Any] = {
        "benchmark": "goodput",
        "command": "python -m bench.goodput " + shlex.join(argv if argv is not None
                                                           else sys.argv[1:]),
        "machine": machine_description(),
        "settings": {"steps": args.steps, "faults": args.faults,
                     "checkpoint_interval": args.checkpoint_interval,
                     "heartbeat_timeout_seconds": args.heartbeat_timeout, "sets": base_sets,
                     "work_dir": str(work_dir)},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": {},
    }
    faults_count = len([f for f in args.faults.split(",") if f.strip()])
    for name in [v for v in args.variants.split(",") if v]:
        plan = plans[name]
        run = run_local_trainer(
            work_dir / name,
            faults=plan["faults"],
            sets=plan["sets"],
            inprocess=plan["inprocess"],
            heartbeat_timeout_seconds=args.heartbeat_timeout,
            max_restarts=faults_count + 3,
            timeout_seconds=args.run_timeout,
            baseline=plan.get("baseline", False),
            collective_timeout_seconds=args.baseline_collective_timeout,
        )
        figures = run_figures(run)
        print(f"[bench.goodput] {name}: rc={run.rc} goodput={figures.get('goodput')} "
              f"wall={figures.get('wall_seconds')} s log={run.log_path}"
              + (" WARNING: trainer sources changed during the run"
                 if run.trainer_source_changed else ""), flush=True)
        results["runs"][name] = {"figures": figures, "run": run.as_dict()}
        if not args.keep_checkpoints:
            results["runs"][name]["checkpoint_bytes_freed"] = free_checkpoints(
                work_dir / name, plan["sets"])
    results["ratio"] = goodput_ratio(results["runs"])
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(args.out, results)
    print(render(results))
    if args.out:
        print(f"\nJSON: {args.out}")
    return 0 if all(r["figures"]["completed"] for r in results["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
