"""The operator end to end: real control plane, process-backed p5 nodes, the real trainer under
ft_launcher with nvrx-control, and the operator as its own process (see conftest.py).

Each test applies a variant of examples/cpu-tiny.yaml (2 nodes x 2 CPU workers) and watches it
through the API server and `kubectl get rtj`, as a user would.
"""

from __future__ import annotations

import copy
import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import yaml
from harness.cluster import Cluster
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROLE = "training.resilient.dev/role"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu-tiny.yaml"
DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "rtj-operator" / "files" / \
    "rtj-dashboard.json"
T = TypeVar("T")


def cpu_tiny(name: str = "cpu-tiny", *, steps: int = 80, faults: str | None = "30:1:sigkill",
             interval_steps: int = 10) -> dict[str, Any]:
    """examples/cpu-tiny.yaml with a name, a step count and faults of the test's choosing."""
    manifest: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    manifest["metadata"]["name"] = name
    spec = manifest["spec"]
    spec["args"] = [f"train.steps={steps}" if a.startswith("train.steps=") else a
                    for a in spec["args"]]
    spec["env"] = [e for e in spec.get("env", []) if e["name"] != "TRAINER_FAULTS"]
    if faults:
        spec["env"].append({"name": "TRAINER_FAULTS", "value": faults})
    spec["checkpoint"]["intervalSteps"] = interval_steps
    return manifest


def apply(cluster: Cluster, namespace: str, manifest: dict[str, Any]) -> None:
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-",
                    input=json.dumps(manifest))


def job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(
        cluster.kubectl("get", "rtj", name, "-n", namespace, "-o", "json").stdout
    )
    return result


def children(cluster: Cluster, namespace: str, name: str) -> list[str]:
    """`kind/name` of every pod, Service and claim labelled as the job's."""
    out = cluster.kubectl(
        "get", "pods,services,persistentvolumeclaims", "-n", namespace,
        "-l", f"training.resilient.dev/job={name}", "-o", "name",
    ).stdout
    return sorted(out.split())


def wait_for(what: str, probe: Callable[[], T | None], *, timeout: float,
             interval: float = 1.0, context: Callable[[], str] = lambda: "") -> T:
    """Poll `probe` until it returns something truthy; fail with `what` and context on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{context()}")
        time.sleep(interval)



def events(cluster: Cluster, ns: str, reason: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    return [e for e in json.loads(out)["items"] if e.get("reason") == reason]


def status(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = job(cluster, ns, name).get("status") or {}
    return result


def describe(cluster: Cluster, ns: str, name: str, operator: OperatorProcess) -> str:
    pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
    current = cluster.kubectl("get", "rtj", "-n", ns, "-o", "yaml", check=False).stdout
    return (f"--- pods\n{pods}\n--- job\n{current[-6000:]}\n"
            f"--- operator log (tail)\n{operator.log()[-4000:]}")


def printed_step(cluster: Cluster, ns: str, name: str) -> int | None:
    """The STEP column of `kubectl get rtj` (None while empty)."""
    lines = cluster.kubectl("get", "rtj", name, "-n", ns).stdout.splitlines()
    header, row = lines[0], lines[1]
    start = header.index("STEP")
    end = header.index("RESTARTS")
    text = row[start:end].strip()
    return int(text) if text.isdigit() else None


def pods_by_role(cluster: Cluster, ns: str, role: str) -> dict[str, dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", ns, "-l", f"{ROLE}={role}", "-o", "json").stdout
    return {p["metadata"]["name"]: p for p in json.loads(out)["items"]}


def summary(cluster: Cluster, ns: str, pod: str) -> dict[str, Any]:
    """The trainer's final summary line (rank 0 prints it last)."""
    for line in reversed(cluster.pod_log(ns, pod).splitlines()):
        if line.startswith('{"event": "summary"'):
            result: dict[str, Any] = json.loads(line)
            return result
    return {}


@pytest.mark.long
def test_cpu_tiny_trains_to_success_under_ft_launcher_across_two_nodes(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """In the long tier: `make test` makes the same checks on examples/cpu-tiny.yaml itself, with
    its three faults, under the helm-installed operator (test_operator_chart.py)."""
    ns, name = namespace, "cpu-tiny"
    apply(cluster, ns, cpu_tiny(name))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731

    trainers = wait_for(
        "both trainer pods running", lambda: (
            p if len(p := pods_by_role(cluster, ns, "trainer")) == 2
            and all(x["status"].get("phase") == "Running" for x in p.values()) else None),
        timeout=120, context=context,
    )
    nodes = {p["spec"]["nodeName"] for p in trainers.values()}
    assert len(nodes) == 2 and all(n.startswith("p5-node-") for n in nodes)
    command = trainers["cpu-tiny-0"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "rtj_trainer.launcher"] and "--nnodes=2" in command

    steps_seen: list[int] = []

    def finished() -> bool:
        step = printed_step(cluster, ns, name)
        if step is not None and (not steps_seen or steps_seen[-1] != step):
            steps_seen.append(step)
        return status(cluster, ns, name).get("state") in ("Succeeded", "Failed")

    wait_for("the job to finish", finished, timeout=600, interval=2, context=context)
    final = status(cluster, ns, name)
    assert final["state"] == "Succeeded", context()
    assert final["step"] == 80
    assert final["lastCheckpoint"]["step"] == 80
    # The column shows the step while the job runs, not only at the end: at least one value
    # strictly between the start and the last step, then the last step. (How many values a 2 s
    # poll sees of an 80-step job depends on the host's load: once only 20 on a loaded CI box.)
    running_steps = [s for s in steps_seen if 0 < s < 80]
    assert running_steps and steps_seen[-1] == 80, f"STEP column while running: {steps_seen}"
    # The injected SIGKILL of rank 1 was handled by ft_launcher inside the pods.
    assert final["restarts"]["launcher"] >= 1 and final["restarts"]["rank"] == 0
    assert summary(cluster, ns, "cpu-tiny-0")["steps"] == 80
    rendezvous = pods_by_role(cluster, ns, "rendezvous")
    assert not rendezvous or all(p["metadata"].get("deletionTimestamp")
                                 for p in rendezvous.values())


def test_a_killed_trainer_pod_is_replaced_alone_and_the_job_succeeds(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "kill-one"
    apply(cluster, ns, cpu_tiny(name, steps=150, faults=None))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("a committed checkpoint", lambda: (
        (status(cluster, ns, name).get("lastCheckpoint") or {}).get("step", 0) >= 20),
        timeout=300, context=context)
    trainers = pods_by_role(cluster, ns, "trainer")
    before = {n: p["metadata"]["uid"] for n, p in trainers.items()}
    rdzv_before = [p["metadata"]["uid"] for p in pods_by_role(cluster, ns, "rendezvous").values()]
    # Every rank's metrics, as a PodMonitor scrapes them (issue 31: the dashboard's panels).
    ranks: list[Sample] = []
    for pod_name, pod in trainers.items():
        for port in pod["spec"]["containers"][0]["ports"]:
            if port["name"].startswith("metrics-"):
                ranks += scrape(f"http://{pod['status']['podIP']}:{port['containerPort']}"
                                f"/metrics", {"namespace": ns, "pod": pod_name})

    cluster.nodes.kill_pod(ns, f"{name}-1")  # SIGKILL every process of the pod

    def replaced() -> dict[str, dict[str, Any]] | None:
        pods = pods_by_role(cluster, ns, "trainer")
        pod = pods.get(f"{name}-1")
        if pod and pod["metadata"]["uid"] != before[f"{name}-1"]:
            return pods
        return None

    after = wait_for("the replacement of pod 1", replaced, timeout=120, context=context)
    assert after[f"{name}-0"]["metadata"]["uid"] == before[f"{name}-0"]
    # The rendezvous pod is compared here, while the job runs: on success it is deleted.
    rdzv_after = [p["metadata"]["uid"] for p in pods_by_role(cluster, ns, "rendezvous").values()]
    assert rdzv_before and rdzv_after == rdzv_before
    labels = after[f"{name}-1"]["metadata"]["labels"]
    assert labels["training.resilient.dev/attempt"] == "1"
    wait_for("the job to finish", lambda: status(cluster, ns, name).get("state")
             in ("Succeeded", "Failed"), timeout=600, interval=2, context=context)
    final = status(cluster, ns, name)
    assert final["state"] == "Succeeded", context()
    assert final["step"] == 150
    assert final["restarts"]["rank"] == 1 and final["restarts"]["full"] == 0
    incident = next(i for i in final["incidents"] if i["action"] == "RankRestart")
    assert incident["nodeIndex"] == 1 and incident["cause"] == "PodFailed"
    assert incident["recoveredTime"] and incident["seconds"] > 0
    # Pod 0 was never replaced (the rendezvous pod was compared above), and no full restart.
    end = pods_by_role(cluster, ns, "trainer")
    assert end[f"{name}-0"]["metadata"]["uid"] == before[f"{name}-0"]
    assert rdzv_before and final["restarts"]["full"] == 0
    # Every panel of the shipped dashboard has data for this job: the operator's metrics after
    # the recovery, and the ranks' metrics scraped while they trained.
    port = operator.env["RTJ_OPERATOR_METRICS_PORT"]
    samples = scrape(f"http://127.0.0.1:{port}/metrics") + ranks
    assert panels_without_data(samples, {"namespace": ns, "job_name": name}) == []
    assert panels_without_data(samples, {"namespace": ns, "job_name": "another-job"})  # (checks)


Sample = tuple[str, dict[str, str], float]
METRIC = re.compile(r"\b(rtj_[a-z0-9_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([a-z_]+)\s*(=~|=)\s*"([^"]*)"')


def scrape(url: str, target: dict[str, str] | None = None) -> list[Sample]:
    """Every sample of a /metrics page; `target`: the labels Prometheus adds to a target's
    series (a PodMonitor's `namespace` and `pod`)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return [(s.name, {**s.labels, **(target or {})}, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples]


def panels_without_data(samples: list[Sample], variables: dict[str, str]) -> list[str]:
    """Each panel target of the shipped dashboard whose metrics no scraped sample could feed:
    a sample of every metric it names, matching its label matchers (dashboard variables
    substituted), carrying every label it aggregates by, with at least one observation for a
    histogram quantile and a 1 for a `== 1` filter."""
    problems = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            by = {label.strip() for group in re.findall(r"by \(([^)]*)\)", expr)
                  for label in group.split(",")}
            for name, selector in METRIC.findall(expr):
                wanted = [(label, op, value.replace("$namespace", variables["namespace"])
                           .replace("$job_name", variables["job_name"]))
                          for label, op, value in MATCHER.findall(selector or "")]
                found = [(labels, value) for sample, labels, value in samples
                         if sample == name and all(
                             (re.fullmatch(value, labels.get(label, "")) if op == "=~"
                              else labels.get(label) == value) for label, op, value in wanted)]
                found = [(labels, value) for labels, value in found
                         if by - {"le"} <= set(labels)]
                if name.endswith("_bucket"):
                    count = name.removesuffix("_bucket") + "_count"
                    found = found if any(s == count and v > 0 for s, _, v in samples) else []
                if "== 1" in expr:
                    found = [(labels, value) for labels, value in found if value == 1]
                if not found:
                    problems.append(f"{panel['title']}: no data for {name}{selector}")
    return problems


def checkpoint_dir(cluster: Cluster, ns: str, claim: str, job_name: str) -> Path:
    """The job's checkpoint directory on this machine (the harness's PVs are hostPath; the
    default `checkpoint.path` is `<namespace>/<name>`)."""
    volume = cluster.kubectl("get", "pvc", claim, "-n", ns, "-o",
                             "jsonpath={.spec.volumeName}").stdout.strip()
    host = cluster.kubectl("get", "pv", volume, "-o", "jsonpath={.spec.hostPath.path}").stdout
    return Path(host.strip()) / ns / job_name


def test_suspend_commits_the_current_step_and_resume_continues_from_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Issue 14: suspend a running job, see a checkpoint of the step at suspension committed,
    resume it, and see training continue from that step with no steps lost."""
    ns, name = namespace, "pause"
    manifest = cpu_tiny(name, steps=150, faults=None)
    # No fault here: gloo's 5 s backstop (parallel.collective_timeout) would only turn a rank
    # that a loaded CI machine starves for 5 s into an in-process restart (seen once: a rank
    # busy with a checkpoint write), and this test counts restarts.
    manifest["spec"]["args"] += ["--set", "resiliency.collective_timeout_seconds=60"]
    # At least 0.25 s a step: on a fast host the 150 steps took less than the status's progress
    # interval (10 s) plus the suspend, so the job ended before it was suspended (2026-12-05).
    manifest["spec"]["args"] += ["--set", "train.min_step_seconds=0.25"]
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("a committed checkpoint", lambda: (
        (status(cluster, ns, name).get("lastCheckpoint") or {}).get("step", 0) >= 30),
        timeout=300, context=context)

    cluster.kubectl("patch", "rtj", name, "-n", ns, "--type=merge",
                    "-p", '{"spec": {"suspend": true}}')
    wait_for("every pod to be gone", lambda: not [
        c for c in children(cluster, ns, name) if c.startswith("pod/")],
        timeout=120, context=context)
    suspended = status(cluster, ns, name)
    assert suspended["state"] == "Suspended"
    assert "persistentvolumeclaim/pause-checkpoints" in children(cluster, ns, name)

    directory = checkpoint_dir(cluster, ns, "pause-checkpoints", name)
    losses = [json.loads(line) for line in (directory / "losses.jsonl").read_text().splitlines()]
    stopped_at = losses[-1]["step"]  # the last step trained before the suspend
    assert 30 <= stopped_at < 150
    commits = [json.loads(line) for line in (directory / "commits.jsonl").read_text().splitlines()]
    stop_logs = lambda: "\n".join(  # noqa: E731
        line for pod in (f"{name}-0", f"{name}-1")
        for line in cluster.pod_log(ns, pod).splitlines()[-400:] if "waitForInput" not in line)
    # that step, committed
    assert commits[-1]["step"] == stopped_at, (stopped_at, commits[-3:], stop_logs())
    assert json.loads((directory / "job-state.json").read_text())["stopped_step"] == stopped_at
    # The operator records it when a pass saw the pods' termination messages before they went.
    recorded = suspended["lastCheckpoint"]["step"]
    assert recorded <= stopped_at
    suspended_condition = next(c for c in suspended["conditions"] if c["type"] == "Suspended")
    if recorded == stopped_at and "before stopping" in suspended_condition["message"]:
        assert f"checkpointed step {stopped_at} before stopping" in suspended_condition["message"]

    cluster.kubectl("patch", "rtj", name, "-n", ns, "--type=merge",
                    "-p", '{"spec": {"suspend": false}}')
    wait_for("the job to finish", lambda: status(cluster, ns, name).get("state")
             in ("Succeeded", "Failed"), timeout=600, interval=2, context=context)
    final = status(cluster, ns, name)
    assert final["state"] == "Succeeded", context()
    assert final["step"] == 150
    resumed = re.findall(r"resumed from \S+ \(step (\d+)\)", cluster.pod_log(ns, f"{name}-0"))
    assert resumed and int(resumed[-1]) == stopped_at, cluster.pod_log(ns, f"{name}-0")[-3000:]
    losses = [json.loads(line) for line in (directory / "losses.jsonl").read_text().splitlines()]
    assert [e["step"] for e in losses] == list(range(1, 151))  # no step lost, none repeated
    assert [r["attempt"] for r in final["ranks"]] == [1, 1]
    assert final["restarts"]["total"] == 0  # a suspend is not a restart
    assert summary(cluster, ns, f"{name}-0")["restarts"] == {"inprocess": 0, "launcher": 0,
                                                             "pod": 0}


def test_deleting_a_job_removes_every_object_the_operator_created(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "gone"
    apply(cluster, ns, cpu_tiny(name, steps=2000, faults=None))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    made = wait_for("pods, Services and the claim", lambda: (
        c if len(c := children(cluster, ns, name)) == 6 else None), timeout=120, context=context)
    assert made == sorted([
        "persistentvolumeclaim/gone-checkpoints", "pod/gone-0", "pod/gone-1", "pod/gone-rdzv",
        "service/gone", "service/gone-rdzv",
    ])
    cluster.kubectl("delete", "rtj", name, "-n", ns, "--wait=false")
    wait_for("every child to be gone", lambda: children(cluster, ns, name) == [],
             timeout=120, context=lambda: "\n".join(children(cluster, ns, name)) + context())
    # Then the job itself: its finalizer goes as soon as its loop stopped, not at kopf's next
    # look a minute later (cancellation_polling).
    wait_for("the job to be gone", lambda: cluster.kubectl(
        "get", "rtj", name, "-n", ns, check=False).returncode != 0, timeout=20, context=context)


def test_deleting_a_job_keeps_a_claim_with_retain_policy(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "kept"
    manifest = cpu_tiny(name, steps=2000, faults=None)
    manifest["spec"]["checkpoint"]["claimDeletePolicy"] = "Retain"
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("pods, Services and the claim", lambda: len(children(cluster, ns, name)) == 6,
             timeout=120, context=context)
    cluster.kubectl("delete", "rtj", name, "-n", ns, "--wait=false")
    left = wait_for("everything but the claim to be gone", lambda: (
        c if (c := children(cluster, ns, name)) == ["persistentvolumeclaim/kept-checkpoints"]
        else None), timeout=120, context=lambda: "\n".join(children(cluster, ns, name)))
    claim = json.loads(cluster.kubectl("get", left[0], "-n", ns, "-o", "json").stdout)
    assert not claim["metadata"].get("ownerReferences")
