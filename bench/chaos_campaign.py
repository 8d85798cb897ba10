"""The fault campaign's bookkeeping (`bench.chaos`): one job run with its planned faults and checked
against the fault-free reference, and one shard's results, rewritten after every job (into
`--out`, or added to the campaign file) so that a shard cut short keeps its finished jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .chaos_faults import FaultKinds, control_plane_outcome
from .chaos_plan import CONTROL_PLANE_KINDS, JobPlan, PlannedFault
from .chaos_results import FaultResult, analyse_fault, campaign_summary, final_loss, summarise
from .common import OPERATOR_SOURCES, REPO_ROOT, TRAINER_SOURCES, source_fingerprint, write_json
from .kubejobs import example_job, result_header

DEFAULT_COMMIT_TIMEOUT = 20.0
"""`checkpoint.commit_timeout_seconds` of a campaign's jobs (the trainer's default: 600 s)."""


def job_manifest(plan: JobPlan, interval: int,
                 commit_timeout: float = DEFAULT_COMMIT_TIMEOUT) -> dict[str, Any]:
    """examples/cpu-tiny.yaml with the plan's steps and trainer faults, budgets for a campaign,
    the trainer's commit deadline at `commit_timeout` seconds (a lost shard write is given up
    that long after the save, so the `write-lost` fault resolves within the job), and a
    control-plane fault's job paced (JobPlan.step_seconds)."""
    manifest = example_job(plan.name, plan.steps, interval, plan.trainer_faults())
    spec = manifest["spec"]
    spec["args"] += ["--set", f"checkpoint.commit_timeout_seconds={commit_timeout:g}"]
    if plan.step_seconds():
        spec["args"] += ["--set", f"train.min_step_seconds={plan.step_seconds():g}"]
    ft = spec["faultTolerance"]
    ft.update(inProcessRestart="Enabled", faultInjection="Enabled", restartStrategy="RankRestart",
              rankRestartBudget={"max": 20, "windowSeconds": 3600},
              fullRestartBudget={"max": 10, "windowSeconds": 3600})
    spec["activeDeadlineSeconds"] = 3600
    return manifest


class Campaign(FaultKinds):
    """The cluster, the operator (restartable) and the jobs, one after the other."""

    def run_job(self, plan: JobPlan, reference_loss: float | None) -> tuple[dict[str, Any],
                                                                             list[FaultResult]]:
        manifest = job_manifest(plan, self.args.checkpoint_interval, self.args.commit_timeout)
        self.cluster.kubectl("apply", "--server-side", "-n", self.namespace, "-f", "-",
                             input=json.dumps(manifest))
        deadline = time.monotonic() + self.args.job_timeout
        commits: dict[int, float] = {}
        results = [self.run_fault(plan, fault, commits, deadline) for fault in plan.faults]
        final = self.wait_for_end(plan.name, commits, deadline)
        for result in results:
            if result.kind in CONTROL_PLANE_KINDS:  # recovered only if the job ended well
                control_plane_outcome(result, final)
                analyse_fault(result, self.records(plan.name), commits)
                self.report(result)
        loss = final_loss(self.records(plan.name), plan.steps)
        job = {
            "job": plan.name, "steps": plan.steps, "final_state": final.get("state"),
            "reason": final.get("reason"), "final_step": final.get("step"),
            "restarts": final.get("restarts"), "final_loss": loss,
            "final_loss_identical": reference_loss is not None and loss == reference_loss,
            "faults": [asdict(f) for f in plan.faults],
        }
        self.cluster.kubectl("delete", "rtj", plan.name, "-n", self.namespace, "--wait=false",
                             check=False)
        return job, results

    def run_fault(self, plan: JobPlan, fault: PlannedFault, commits: dict[int, float],
                  deadline: float) -> FaultResult:
        """Inject one planned fault, wait for the way back, and say what it cost."""
        result = FaultResult(plan.name, fault.kind, fault.step, fault.rank)
        try:
            self.inject(plan, fault, result, commits, deadline)
            self.wait_for_recovery(plan, result, commits, deadline)
        except Exception as error:  # one fault's failure is a result, not the campaign's end
            result.detail["error"] = f"{type(error).__name__}: {error}"
        finally:
            self.after(fault, result)
        if result.kind not in CONTROL_PLANE_KINDS:  # those: at the job's end (run_job)
            analyse_fault(result, self.records(plan.name), commits)
            self.report(result)
        return result

    @staticmethod
    def report(result: FaultResult) -> None:
        print(f"[bench.chaos] {result.job} {result.kind}@{result.step}: "
              f"recovered={result.recovered} seconds={result.seconds} "
              f"lost={result.steps_lost_beyond_commit} {result.detail or ''}", flush=True)

    def wait_for_end(self, name: str, commits: dict[int, float],
                     deadline: float) -> dict[str, Any]:
        """The job's status once it Succeeded or Failed (or at the deadline)."""
        final: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.note_commits(name, commits)
            try:
                final = self.status(name)
            except Exception:  # the API server still warming up after a control-plane fault
                time.sleep(1)
                continue
            if final.get("state") in ("Succeeded", "Failed"):
                break
            time.sleep(1)
        return final


def git_commit() -> str:
    """The commit the code was run at (`+dirty` when the work tree differs from it)."""
    import subprocess

    def git(*words: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), *words], capture_output=True,
                              text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "bench", "operator",
                "trainer", "tests/harness")
    return commit + ("+dirty" if dirty else "")


class Shard:
    """One run's results (a campaign's shard, a smoke run or a replay) and where they go: `--out`,
    or, with a campaign file (`campaign`: its content before this shard), that file, with this
    shard added and the summary over every shard."""

    def __init__(self, args: argparse.Namespace, argv: list[str] | None, plans: list[JobPlan],
                 campaign: dict[str, Any] | None) -> None:
        self.args = args
        self.campaign = campaign
        self.results: dict[str, Any] = {
            **result_header("chaos", argv, args, commit=git_commit()),
            "operator_and_trainer_source": source_fingerprint(*OPERATOR_SOURCES,
                                                              *TRAINER_SOURCES),
            "planned_jobs": len(plans),
            "planned_faults": sum(len(plan.faults) for plan in plans),
        }
        self.jobs: list[dict[str, Any]] = []
        self.faults: list[FaultResult] = []

    def save(self, final: bool, operator_starts: int) -> None:
        results = self.results
        results.update(jobs=self.jobs, faults=[asdict(f) for f in self.faults],
                       summary=summarise(self.faults, self.jobs), operator_starts=operator_starts)
        if final:
            results.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           load_average_at_end=[round(x, 2) for x in os.getloadavg()])
        if self.campaign is None:
            write_json(self.args.out, results)
            return
        assert self.args.campaign is not None
        shards = [*self.campaign["shards"], results]
        write_json(self.args.campaign, {"benchmark": "chaos-campaign",
                                        "target_faults_per_kind": self.args.faults_per_kind,
                                        "summary": campaign_summary(shards), "shards": shards})

    def run(self, plans: list[JobPlan], work_dir: Path) -> None:
        """Start the cluster and run the plans' jobs one after the other, each after the
        fault-free reference of its length, until `--minutes` are up; save after every job."""
        minutes = self.args.minutes
        began = time.monotonic()
        campaign = Campaign(self.args, work_dir)
        try:
            # The learning-rate schedule depends on the run's length: one reference per length,
            # trained just before the first job of that length.
            references: dict[int, dict[str, Any]] = {}
            for plan in plans:
                if minutes is not None and time.monotonic() - began > minutes * 60:
                    print(f"[bench.chaos] {minutes:g} minutes are up: {len(self.jobs)} of "
                          f"{len(plans)} jobs ran", flush=True)
                    break
                if plan.steps not in references:
                    references[plan.steps], _ = campaign.run_job(
                        JobPlan(f"{plan.name.rsplit('-', 1)[0]}-reference-{plan.steps}",
                                plan.steps, ()), None)
                    self.results["references"] = list(references.values())
                job, found = campaign.run_job(plan, references[plan.steps]["final_loss"])
                self.jobs.append(job)
                self.faults.extend(found)
                self.save(final=False, operator_starts=campaign.operator_starts)
        finally:
            campaign.stop()
        self.save(final=True, operator_starts=campaign.operator_starts)
