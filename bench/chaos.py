"""A fault campaign on Kubernetes: many faults of every kind over several jobs, each job checked
for the three things a user cares about.

Starts the local cluster (real control plane, three process-backed p5-like nodes; tests/harness)
and the operator, trains one fault-free reference job, then runs the campaign's jobs one after
the other. Each job is examples/cpu-tiny.yaml's shape (2 pods x 2 ranks of the tiny CPU trainer
under ft_launcher, in-process restart on, checkpoints every `--checkpoint-interval` steps) with
`--faults-per-job` faults, one every `--spacing` steps. The fault kinds:

- `exception`, `sigkill`, `hang`: `TRAINER_FAULTS` (on one rank at the planned step the trainer
  raises, SIGKILLs its own worker, or stops making progress while alive);
- `pod-kill`: the harness SIGKILLs every process of pod `<job>-1`;
- `node-partition`: the harness partitions the node that runs pod `<job>-1` (no Lease, no status,
  frozen processes) and heals it once the job trains again, or, when the job's rendezvous pod
  runs there too, as soon as the operator has force-deleted that pod (a harness limit: see
  `Campaign.heal_once_rendezvous_replaced`);
- `rendezvous-kill`: the harness SIGKILLs the rendezvous pod `<job>-rdzv`;
- `operator-kill`: pod `<job>-1` is killed and the operator is SIGKILLed as soon as it acted on
  it, then started again;
- `writer-kill`: the asynchronous checkpoint writer process of one rank's pod is SIGKILLed.

For every fault it reports: recovered or not; the seconds from the fault to the first completed
step after it (rank 0's `losses.jsonl`); the step training resumed from and the newest checkpoint
committed when the fault happened; and the **steps lost beyond the last commit** (committed step
minus resumed step, 0 when the job resumed from the newest commit). For every job: the final
state, and whether the final loss is bit-identical to the reference job's.

Targets (issue 11): every job Succeeded, 0 steps lost beyond the last committed checkpoint,
final loss identical to the fault-free run.

The steps lost beyond the last commit compare the resumed step with the newest checkpoint whose
manifest was committed before the fault (`read_commits`: the manifests' own `step` and
`committed_at`).

The whole campaign (100 faults of each kind, about 200 jobs) takes ten hours on a 2-core machine,
more than one working session, so it can be run in shards that add up in one campaign file: each
shard plans only the faults of each kind that the earlier shards have not injected yet, starts no
new job after `--minutes`, records the commit it ran at, and rewrites the file after every job
(a shard cut short keeps its finished jobs). The file's `summary` covers every shard.

    python -m bench.chaos --faults-per-kind 100 --out bench/results/chaos.json  # all at once
    python -m bench.chaos --campaign bench/results/chaos-campaign.json --minutes 60  # a shard
    python -m bench.chaos --faults-per-kind 2 --out /tmp/chaos.json             # a smoke run
    python -m bench.chaos --campaign bench/results/chaos-campaign.json \
        --replay chaos-s0-1 --out /tmp/replay.json     # a recorded job's faults, again
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rtj_trainer.checkpoint.format import step_of

from .common import (
    OPERATOR_SOURCES,
    REPO_ROOT,
    TRAINER_SOURCES,
    StampedProcess,
    add_output_arguments,
    describe_spread,
    format_spread,
    format_table,
    machine_description,
    source_fingerprint,
    write_json,
)
from .kubejobs import EXAMPLE, GROUP_PATH
from .localrun import StepRecord, read_fault_times, read_losses

sys.path.insert(0, str(REPO_ROOT / "tests"))
TRAINER_KINDS = ("exception", "sigkill", "hang")
"""Faults the trainer injects itself (TRAINER_FAULTS); the others the campaign injects."""
KINDS = (*TRAINER_KINDS, "pod-kill", "node-partition", "rendezvous-kill", "operator-kill",
         "writer-kill")
RANKS = 4
"""2 pods x 2 ranks."""


# --- the plan (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    step: int
    """The fault happens once the job has completed step - 1 (trainer faults: at step's start)."""
    rank: int
    """The rank a trainer fault fires on (the writer kill's rank); 0..RANKS-1."""


@dataclass(frozen=True)
class JobPlan:
    name: str
    steps: int
    faults: tuple[PlannedFault, ...]

    def trainer_faults(self) -> str:
        """TRAINER_FAULTS for the trainer-injected faults (`STEP:RANK:KIND,...`)."""
        return ",".join(f"{f.step}:{f.rank}:{f.kind}" for f in self.faults
                        if f.kind in TRAINER_KINDS)


def plan_campaign(kinds: list[str], per_kind: int, faults_per_job: int, spacing: int,
                  seed: int) -> list[JobPlan]:
    """Every kind `per_kind` times, shuffled with `seed`, packed `faults_per_job` to a job: fault
    i of a job at step `spacing * (i + 1)`, the job `spacing` steps longer than its last fault."""
    if per_kind < 1:
        raise ValueError("per_kind >= 1, faults_per_job >= 1 and spacing >= 2 are needed")
    return plan_faults(dict.fromkeys(kinds, per_kind), faults_per_job, spacing, seed)


def plan_faults(counts: dict[str, int], faults_per_job: int, spacing: int, seed: int,
                prefix: str = "chaos") -> list[JobPlan]:
    """`counts[kind]` faults of each kind, shuffled with `seed`, packed `faults_per_job` to a
    job named `<prefix>-<n>` (see plan_campaign)."""
    if faults_per_job < 1 or spacing < 2 or any(n < 0 for n in counts.values()):
        raise ValueError("per_kind >= 1, faults_per_job >= 1 and spacing >= 2 are needed")
    unknown = [k for k in counts if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds: {', '.join(unknown)}")
    rng = random.Random(seed)
    pool = [kind for kind, n in counts.items() for _ in range(n)]
    rng.shuffle(pool)
    jobs = []
    for number, start in enumerate(range(0, len(pool), faults_per_job)):
        chunk = pool[start:start + faults_per_job]
        faults = tuple(PlannedFault(kind, spacing * (i + 1), rng.randrange(RANKS))
                       for i, kind in enumerate(chunk))
        jobs.append(JobPlan(f"{prefix}-{number}", spacing * (len(chunk) + 1), faults))
    return jobs


def replay_plans(campaign: dict[str, Any], names: list[str]) -> list[JobPlan]:
    """The recorded fault plans (steps, kinds, steps of the faults, ranks) of these jobs of a
    campaign, to run again under the name `<job>-replay`. An unknown job name is a ValueError
    that names it."""
    recorded = {job["job"]: job for shard in campaign.get("shards", [])
                for job in shard.get("jobs", [])}
    unknown = [name for name in names if name not in recorded]
    if unknown:
        raise ValueError(f"--replay: no job named {', '.join(unknown)} in the campaign file")
    plans = []
    for name in names:
        job = recorded[name]
        faults = tuple(PlannedFault(f["kind"], int(f["step"]), int(f["rank"]))
                       for f in job["faults"])
        unknown_kinds = sorted({f.kind for f in faults} - set(KINDS))
        if unknown_kinds:
            raise ValueError(f"--replay: job {name} has unknown fault kinds "
                             f"{', '.join(unknown_kinds)}")
        plans.append(JobPlan(f"{name}-replay", int(job["steps"]), faults))
    return plans


def still_to_run(kinds: list[str], per_kind: int, done: list[dict[str, Any]]) -> dict[str, int]:
    """What a new shard of a campaign of `per_kind` faults of every kind must still inject:
    `per_kind` minus the faults of that kind the earlier shards injected (`done`: their fault
    records), never below 0."""
    counted = Counter(f["kind"] for f in done)
    return {kind: max(0, per_kind - counted[kind]) for kind in kinds}


# --- the analysis (pure) ------------------------------------------------------------------------


@dataclass
class FaultResult:
    job: str
    kind: str
    step: int
    rank: int
    injected_at: float | None = None
    recovered: bool = False
    seconds: float | None = None
    """Fault -> the first step completed after it."""
    resumed_step: int | None = None
    """The step training resumed from (the first step after the fault, minus one)."""
    committed_at_fault: int | None = None
    """The newest checkpoint committed when the fault happened (-1: none yet)."""
    steps_lost_beyond_commit: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def analyse_fault(result: FaultResult, records: list[StepRecord],
                  commits: dict[int, float]) -> FaultResult:
    """Fill the recovery fields from rank 0's step records and when each checkpoint step was
    first seen committed (step -> unix time).

    Recovered means a new training attempt (another attempt identity: a new process group after
    an in-process, launcher, pod or full restart) completed a step after the fault. A fault that
    needed no restart (the job went on in the same attempt to its end, as when a writer died
    between saves) is recovered and `absorbed`, with no seconds."""
    if result.injected_at is None:
        return result
    committed = [step for step, at in commits.items() if at <= result.injected_at]
    result.committed_at_fault = max(committed, default=-1)
    before = [r for r in records if r.at <= result.injected_at]
    running = max(before, key=lambda r: r.at).attempt if before else None
    after = [r for r in records if r.at > result.injected_at and r.attempt != running]
    if not after:
        if result.detail.get("job_ended"):
            result.recovered = True
            result.detail["absorbed"] = True
            result.steps_lost_beyond_commit = 0
        return result
    first = min(after, key=lambda r: r.at)
    result.recovered = True
    result.seconds = round(first.at - result.injected_at, 3)
    result.resumed_step = first.step - 1
    result.steps_lost_beyond_commit = max(0, result.committed_at_fault - result.resumed_step)
    return result


def read_commits(directory: Path, commits: dict[int, float]) -> dict[int, float]:
    """Add to `commits` (step -> unix time of the commit) every checkpoint committed under the
    job's checkpoint directory: a `step-<9 digits>.<attempt>/manifest.json` (named by
    rtj_trainer.checkpoint.format), read for its `step` and `committed_at`. A step already known
    keeps its time (the campaign polls, so that is its first commit; a later attempt may commit
    the same step again); a manifest being replaced or unreadable is skipped this time."""
    for manifest in directory.glob("step-*/manifest.json"):
        step = step_of(manifest.parent.name)
        if step is None or step in commits:
            continue
        try:
            data = json.loads(manifest.read_text())
            commits[int(data["step"])] = float(data["committed_at"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return commits


def final_loss(records: list[StepRecord], steps: int) -> float | None:
    """The loss of the last step as the last attempt computed it."""
    finals = [r for r in records if r.step == steps]
    return max(finals, key=lambda r: r.at).loss if finals else None


def summarise(faults: list[FaultResult], jobs: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, Any] = {}
    for kind in sorted({f.kind for f in faults}):
        mine = [f for f in faults if f.kind == kind]
        by_kind[kind] = {
            "faults": len(mine),
            "recovered": sum(1 for f in mine if f.recovered),
            "seconds": describe_spread([f.seconds for f in mine]),
            "max_steps_lost_beyond_commit": max(
                (f.steps_lost_beyond_commit or 0 for f in mine), default=0),
        }
    return {
        "faults": len(faults),
        "recovered": sum(1 for f in faults if f.recovered),
        "steps_lost_beyond_commit": sum(f.steps_lost_beyond_commit or 0 for f in faults),
        "jobs": len(jobs),
        "jobs_succeeded": sum(1 for j in jobs if j.get("final_state") == "Succeeded"),
        "jobs_final_loss_identical": sum(1 for j in jobs if j.get("final_loss_identical")),
        "by_kind": by_kind,
    }


def render(summary: dict[str, Any]) -> str:
    rows = [[kind, str(k["faults"]), str(k["recovered"]), format_spread(k["seconds"]),
             str(k["max_steps_lost_beyond_commit"])] for kind, k in summary["by_kind"].items()]
    return "\n".join([
        f"jobs Succeeded {summary['jobs_succeeded']}/{summary['jobs']}, final loss identical to "
        f"the fault-free run {summary['jobs_final_loss_identical']}/{summary['jobs']}; faults "
        f"recovered {summary['recovered']}/{summary['faults']}, steps lost beyond the last "
        f"commit {summary['steps_lost_beyond_commit']}",
        "",
        format_table(["kind", "faults", "recovered", "fault → next step (s)",
                      "max steps lost beyond commit"], rows),
    ])


# --- the campaign (cluster) ---------------------------------------------------------------------


def job_manifest(plan: JobPlan, interval: int) -> dict[str, Any]:
    """examples/cpu-tiny.yaml with the plan's steps and trainer faults, budgets for a campaign."""
    manifest: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    manifest["metadata"]["name"] = plan.name
    spec = manifest["spec"]
    spec["args"] = [f"train.steps={plan.steps}" if a.startswith("train.steps=") else a
                    for a in spec["args"]]
    spec["env"] = [e for e in spec.get("env", []) if e["name"] != "TRAINER_FAULTS"]
    if plan.trainer_faults():
        spec["env"].append({"name": "TRAINER_FAULTS", "value": plan.trainer_faults()})
    if not spec["env"]:
        del spec["env"]
    spec["checkpoint"]["intervalSteps"] = interval
    ft = spec["faultTolerance"]
    ft.update(inProcessRestart="Enabled", faultInjection="Enabled", restartStrategy="RankRestart",
              rankRestartBudget={"max": 20, "windowSeconds": 3600},
              fullRestartBudget={"max": 10, "windowSeconds": 3600})
    spec["activeDeadlineSeconds"] = 3600
    return manifest


class Campaign:
    """The cluster, the operator (restartable) and the jobs, one after the other."""

    def __init__(self, args: argparse.Namespace, work_dir: Path) -> None:
        from harness.cluster import Cluster

        self.args = args
        self.work_dir = work_dir
        self.cluster = Cluster.start(work_dir / "cluster", nodes=3)
        self.namespace = self.cluster.create_namespace("chaos")
        self.operator: StampedProcess | None = None
        self.operator_starts = 0
        from .kubejobs import operator_ports

        self.operator_ports = operator_ports()
        """Kept across operator restarts: the running jobs' pods use its rendezvous port."""
        self.start_operator()

    def start_operator(self) -> None:
        from .kubejobs import start_operator

        self.operator_starts += 1
        self.operator = start_operator(
            self.cluster, self.work_dir / f"operator-{self.operator_starts}.log", None,
            self.operator_ports)

    def kill_operator(self) -> None:
        assert self.operator is not None
        self.operator.process.send_signal(signal.SIGKILL)
        self.operator.process.wait(timeout=30)

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        self.cluster.stop()

    # -- reading a job ---------------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        job = self.cluster.api.get_or_none(
            f"{GROUP_PATH}/namespaces/{self.namespace}/resilienttrainingjobs/{name}") or {}
        result: dict[str, Any] = job.get("status") or {}
        return result

    def job_dir(self, name: str) -> Path | None:
        # The claim's directory, then checkpoint.path (`<namespace>/<name>` by default).
        found = sorted(Path(self.cluster.shared_dir).glob(
            f"{self.namespace}-{name}-*/{self.namespace}/{name}"))
        return found[0] if found else None

    def records(self, name: str) -> list[StepRecord]:
        directory = self.job_dir(name)
        return read_losses(directory / "losses.jsonl") if directory else []

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.cluster.api.get_or_none(f"/api/v1/namespaces/{self.namespace}/pods/{name}")

    # -- one job ---------------------------------------------------------------------------------

    def run_job(self, plan: JobPlan, reference_loss: float | None) -> tuple[dict[str, Any],
                                                                             list[FaultResult]]:
        manifest = job_manifest(plan, self.args.checkpoint_interval)
        self.cluster.kubectl("apply", "--server-side", "-n", self.namespace, "-f", "-",
                             input=json.dumps(manifest))
        deadline = time.monotonic() + self.args.job_timeout
        commits: dict[int, float] = {}
        results = []
        for fault in plan.faults:
            result = FaultResult(plan.name, fault.kind, fault.step, fault.rank)
            try:
                self.inject(plan, fault, result, commits, deadline)
                self.wait_for_recovery(plan, result, commits, deadline)
            except Exception as error:  # one fault's failure is a result, not the campaign's end
                result.detail["error"] = f"{type(error).__name__}: {error}"
            finally:
                self.after(fault, result)
            analyse_fault(result, self.records(plan.name), commits)
            print(f"[bench.chaos] {plan.name} {fault.kind}@{fault.step}: "
                  f"recovered={result.recovered} seconds={result.seconds} "
                  f"lost={result.steps_lost_beyond_commit} {result.detail or ''}", flush=True)
            results.append(result)
        final: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self.note_commits(plan.name, commits)
            final = self.status(plan.name)
            if final.get("state") in ("Succeeded", "Failed"):
                break
            time.sleep(1)
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

    def note_commits(self, name: str, commits: dict[int, float]) -> None:
        """Remember when each checkpoint step was committed (its manifest's `committed_at`)."""
        directory = self.job_dir(name)
        if directory is not None:
            read_commits(directory, commits)

    def wait_until(self, what: str, deadline: float, predicate: Any, commits: dict[int, float],
                   name: str) -> Any:
        while time.monotonic() < deadline:
            self.note_commits(name, commits)
            value = predicate()
            if value:
                return value
            state = self.status(name).get("state")
            if state in ("Succeeded", "Failed"):
                raise TimeoutError(f"the job ended ({state}) while waiting for {what}")
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}")

    def inject(self, plan: JobPlan, fault: PlannedFault, result: FaultResult,
               commits: dict[int, float], deadline: float) -> None:
        name = plan.name
        if fault.kind in TRAINER_KINDS:
            marker = f"step{fault.step}-rank{fault.rank}-{fault.kind}"

            def fired() -> float | None:
                directory = self.job_dir(name)
                return read_fault_times(directory).get(marker) if directory else None

            result.injected_at = self.wait_until(f"fault {marker} to fire", deadline, fired,
                                                 commits, name)
            return
        self.wait_until(f"step {fault.step - 1}", deadline,
                        lambda: any(r.step >= fault.step - 1 for r in self.records(name)),
                        commits, name)
        victim = f"{name}-1"
        if fault.kind == "pod-kill":
            result.injected_at = time.time()
            self.cluster.nodes.kill_pod(self.namespace, victim, 9)
        elif fault.kind == "rendezvous-kill":
            result.injected_at = time.time()
            self.cluster.nodes.kill_pod(self.namespace, f"{name}-rdzv", 9)
        elif fault.kind == "node-partition":
            pod = self.pod(victim) or {}
            node = pod.get("spec", {}).get("nodeName")
            if not node:
                raise TimeoutError(f"pod {victim} has no node")
            result.detail["node"] = node
            rendezvous = self.pod(f"{name}-rdzv") or {}
            shared = rendezvous.get("spec", {}).get("nodeName") == node
            result.injected_at = time.time()
            self.cluster.nodes.partition_node(node)
            if shared:
                self.heal_once_rendezvous_replaced(plan, rendezvous, result, commits, deadline)
        elif fault.kind == "operator-kill":
            uid = (self.pod(victim) or {}).get("metadata", {}).get("uid")
            result.injected_at = time.time()
            self.cluster.nodes.kill_pod(self.namespace, victim, 9)

            def acted() -> bool:
                pod = self.pod(victim)
                return pod is None or pod["metadata"]["uid"] != uid or bool(
                    pod["metadata"].get("deletionTimestamp"))

            self.wait_until("the operator to act", deadline, acted, commits, name)
            self.kill_operator()
            result.detail["operator_killed_after_seconds"] = round(
                time.time() - result.injected_at, 2)
            time.sleep(1)
            self.start_operator()
        elif fault.kind == "writer-kill":
            result.injected_at = self.kill_writer(plan, fault, commits, deadline)

    def heal_once_rendezvous_replaced(self, plan: JobPlan, rendezvous: dict[str, Any],
                                      result: FaultResult, commits: dict[int, float],
                                      deadline: float) -> None:
        """The partitioned node also runs the job's rendezvous pod. The harness's pods share one
        network namespace, and nvrx-control's TCPStore listens on the port on every address, so
        the frozen process of the force-deleted rendezvous pod keeps the port and no replacement
        can listen on it (EADDRINUSE; on a cluster each pod has its own network namespace).
        Once the operator has force-deleted that pod (its part: NodeLost, a full restart), the
        node is healed, which kills the processes of the pods force-deleted there, as a kubelet
        does when it reconnects."""
        uid = rendezvous.get("metadata", {}).get("uid")

        def replaced() -> bool:
            now = self.pod(f"{plan.name}-rdzv")
            return now is None or now["metadata"]["uid"] != uid

        self.wait_until("the operator to force-delete the rendezvous pod", deadline, replaced,
                        commits, plan.name)
        assert result.injected_at is not None
        result.detail["rendezvous_on_node"] = True
        result.detail["healed_after_seconds"] = round(time.time() - result.injected_at, 2)
        self.cluster.nodes.heal_node(result.detail["node"])

    def kill_writer(self, plan: JobPlan, fault: PlannedFault, commits: dict[int, float],
                    deadline: float) -> float:
        """SIGKILL the asynchronous checkpoint writer of the pod that runs `fault.rank`."""
        pod = f"{plan.name}-{fault.rank // 2}"

        def writer() -> int | None:
            return find_writer(self.pod_pids(pod))

        pid = self.wait_until(f"a checkpoint writer in pod {pod}", deadline, writer, commits,
                              plan.name)
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        return at

    def pod_pids(self, pod: str) -> set[int]:
        """Every process of the pod: its cgroup (torchelastic starts workers in sessions of
        their own, so process groups miss them)."""
        for described in self.cluster.nodes.pods():
            if described["namespace"] == self.namespace and described["name"] == pod:
                cgroup = described.get("cgroup")
                if not cgroup:
                    return set()
                pids: set[int] = set()
                for procs in Path(cgroup).rglob("cgroup.procs"):
                    try:
                        pids.update(int(x) for x in procs.read_text().split())
                    except (OSError, ValueError):
                        continue
                return pids
        return set()

    def wait_for_recovery(self, plan: JobPlan, result: FaultResult, commits: dict[int, float],
                          deadline: float) -> None:
        """Until a new attempt completed a step after the fault, or the job ended (a fault that
        needed no restart: `analyse_fault` calls it absorbed)."""
        assert result.injected_at is not None
        injected = result.injected_at
        records = self.records(plan.name)
        before = [r for r in records if r.at <= injected]
        running = max(before, key=lambda r: r.at).attempt if before else None

        def new_attempt() -> bool:
            return any(r.at > injected and r.attempt != running
                       for r in self.records(plan.name))

        try:
            self.wait_until("a new attempt's first step after the fault", deadline, new_attempt,
                            commits, plan.name)
        except TimeoutError:
            if self.status(plan.name).get("state") != "Succeeded":
                raise
            result.detail["job_ended"] = True

    def after(self, fault: PlannedFault, result: FaultResult) -> None:
        if fault.kind == "node-partition" and "node" in result.detail:
            self.cluster.nodes.heal_node(result.detail["node"])
        if self.operator is not None and self.operator.process.poll() is not None:
            self.start_operator()


def find_writer(pids: set[int]) -> int | None:
    """The pid of a checkpoint writer process (named `rtj-ckpt-writer` by the trainer) among
    these processes."""
    for pid in sorted(pids):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name == "rtj-ckpt-writer":
            return pid
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated fault kinds (default all: {','.join(KINDS)})")
    parser.add_argument("--faults-per-kind", type=int, default=100,
                        help="faults of each kind in the campaign (default 100); with --campaign, "
                             "the campaign's total over all its shards")
    parser.add_argument("--faults-per-job", type=int, default=4,
                        help="faults in one job (default 4)")
    parser.add_argument("--spacing", type=int, default=25,
                        help="steps between two faults of a job (default 25)")
    parser.add_argument("--checkpoint-interval", type=int, default=10,
                        help="checkpoint.intervalSteps (default 10)")
    parser.add_argument("--seed", type=int, default=11,
                        help="shuffle seed (default 11; with --campaign, plus the shard's number)")
    parser.add_argument("--job-timeout", type=float, default=900.0,
                        help="give up on one job after this many seconds (default 900)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no new job after this many minutes (default: no limit); the "
                             "jobs not started stay for the campaign's next shard")
    parser.add_argument("--campaign", type=Path, default=None,
                        help="a campaign file: run one more shard of it (the faults of each kind "
                             "still missing from --faults-per-kind), add the shard to the file "
                             "after every job, and summarise every shard together")
    parser.add_argument("--replay", action="append", default=[], metavar="JOB",
                        help="run this job of --campaign again with its recorded faults (the "
                             "same steps, kinds and ranks) at today's code (repeatable); the "
                             "results go to --out and the campaign file is left as it is")
    add_output_arguments(parser, work_dir_help="cluster run directory (default: a new temp dir)")
    args = parser.parse_args(argv)
    if args.replay and args.campaign is None:
        parser.error("--replay needs --campaign (the file the jobs are read from)")
    return args


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


def read_campaign(path: Path) -> dict[str, Any]:
    """The campaign file's content, or a new campaign when there is no file yet."""
    if not path.exists():
        return {"benchmark": "chaos-campaign", "shards": []}
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("benchmark") != "chaos-campaign" or not isinstance(data.get("shards"), list):
        raise ValueError(f"{path} is not a bench.chaos campaign file")
    return data


def campaign_summary(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """summarise() over every shard's faults and jobs."""
    faults = [FaultResult(**f) for shard in shards for f in shard.get("faults", [])]
    jobs = [job for shard in shards for job in shard.get("jobs", [])]
    return summarise(faults, jobs)


def passed(summary: dict[str, Any]) -> bool:
    """Issue 11's targets: every job Succeeded with the fault-free run's final loss, every fault
    recovered, no step lost beyond the last commit."""
    return bool(summary["jobs_succeeded"] == summary["jobs"] == summary["jobs_final_loss_identical"]
                and summary["steps_lost_beyond_commit"] == 0
                and summary["recovered"] == summary["faults"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    campaign_data = read_campaign(args.campaign) if args.campaign else None
    if args.replay:
        assert campaign_data is not None
        plans = replay_plans(campaign_data, args.replay)
        campaign_data = None  # a replay writes --out, never the campaign file
    elif campaign_data is None:
        plans = plan_campaign(kinds, args.faults_per_kind, args.faults_per_job, args.spacing,
                              args.seed)
    else:
        number = len(campaign_data["shards"])
        done = [f for shard in campaign_data["shards"] for f in shard.get("faults", [])]
        plans = plan_faults(still_to_run(kinds, args.faults_per_kind, done),
                            args.faults_per_job, args.spacing, args.seed + number,
                            prefix=f"chaos-s{number}")
        if not plans:
            print(f"[bench.chaos] {args.campaign}: every kind has its {args.faults_per_kind} "
                  "faults already")
            print(render(campaign_summary(campaign_data["shards"])))
            return 0 if passed(campaign_summary(campaign_data["shards"])) else 1
    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-chaos."))).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "benchmark": "chaos",
        "command": "python -m bench.chaos " + shlex.join(
            argv if argv is not None else sys.argv[1:]),
        "commit": git_commit(),
        "machine": machine_description(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "operator_and_trainer_source": source_fingerprint(*OPERATOR_SOURCES, *TRAINER_SOURCES),
        "planned_jobs": len(plans),
        "planned_faults": sum(len(plan.faults) for plan in plans),
    }
    jobs: list[dict[str, Any]] = []
    faults: list[FaultResult] = []

    def save(final: bool) -> None:
        results.update(jobs=jobs, faults=[asdict(f) for f in faults],
                       summary=summarise(faults, jobs), operator_starts=campaign.operator_starts)
        if final:
            results.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           load_average_at_end=[round(x, 2) for x in os.getloadavg()])
        if campaign_data is None:
            write_json(args.out, results)
            return
        assert args.campaign is not None
        shards = [*campaign_data["shards"], results]
        write_json(args.campaign, {"benchmark": "chaos-campaign",
                                   "target_faults_per_kind": args.faults_per_kind,
                                   "summary": campaign_summary(shards), "shards": shards})

    began = time.monotonic()
    campaign = Campaign(args, work_dir)
    try:
        # The learning-rate schedule depends on the run's length: one reference per length,
        # trained just before the first job of that length.
        references: dict[int, dict[str, Any]] = {}
        for plan in plans:
            if args.minutes is not None and time.monotonic() - began > args.minutes * 60:
                print(f"[bench.chaos] {args.minutes:g} minutes are up: {len(jobs)} of "
                      f"{len(plans)} jobs ran", flush=True)
                break
            if plan.steps not in references:
                references[plan.steps], _ = campaign.run_job(
                    JobPlan(f"{plan.name.rsplit('-', 1)[0]}-reference-{plan.steps}",
                            plan.steps, ()), None)
                results["references"] = list(references.values())
            job, found = campaign.run_job(plan, references[plan.steps]["final_loss"])
            jobs.append(job)
            faults.extend(found)
            save(final=False)
    finally:
        campaign.stop()
    save(final=True)
    print(render(results["summary"]))
    if campaign_data is not None:
        total = campaign_summary([*campaign_data["shards"], results])
        print(f"\nthe whole campaign ({len(campaign_data['shards']) + 1} shards):")
        print(render(total))
        print(f"\nJSON: {args.campaign}")
        return 0 if passed(results["summary"]) and passed(total) else 1
    if args.out:
        print(f"\nJSON: {args.out}")
    return 0 if passed(results["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
