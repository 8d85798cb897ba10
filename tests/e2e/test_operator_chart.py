"""The operator as the chart installs it: `helm install`, then jobs, on the real cluster.

The harness runs the chart's Deployment pods like any pod (the real deployment and replicaset
controllers make them; the harness kubelet starts `python -m rtj_operator` with the pod's projected
ServiceAccount token and KUBERNETES_SERVICE_HOST/PORT, and no kubeconfig), so the operator talks to
the API server as the chart's ServiceAccount, under exactly the chart's RBAC. Each test installs
its own release into its own namespace and uninstalls it afterwards.

- cluster-scoped install (ClusterRoles, every namespace): examples/cpu-tiny.yaml, applied as the
  file is, with its three injected faults, runs on two nodes under ft_launcher, shows its step in
  `kubectl get rtj` while it runs and reaches Succeeded with the trainer's last step and commit;
- namespaced install (Roles in one namespace): a job there Succeeds; a job in another namespace
  is never touched (no finalizer, no status, no pods);
- two replicas with leader election: a trainer pod is killed, and as soon as the leader has acted
  on it, the leader is SIGKILLed; the follower takes the Lease, nothing is done twice (one
  replacement pod, one incident, one budget record) and the job Succeeds.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.test_operator_jobs import (
    apply,
    cpu_tiny,
    pods_by_role,
    printed_step,
    status,
    summary,
    wait_for,
)
from harness.cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rtj-operator"
EXAMPLE = ROOT / "examples" / "cpu-tiny.yaml"
GROUP = "training.resilient.dev"
OPERATOR_SELECTOR = "app.kubernetes.io/name=rtj-operator"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Release:
    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.name = f"rtj{uuid.uuid4().hex[:6]}"
        self.fullname = f"{self.name}-rtj-operator"
        self.installed = False

    def install(self, *values: str) -> None:
        self.cluster.helm(
            "install", self.name, str(CHART), "--namespace", self.namespace, "--skip-crds",
            "--set", "operator.reconcileIntervalSeconds=2",
            # nvrx-control listens on every address: keep off other users' rendezvous ports.
            "--set", f"operator.rendezvousPort={free_port()}",
            *values,
        )  # fmt: skip
        self.installed = True

    def pods(self) -> list[dict[str, Any]]:
        listed = self.cluster.api.get(f"/api/v1/namespaces/{self.namespace}/pods",
                                      labelSelector=OPERATOR_SELECTOR)
        return list(listed["items"])

    def logs(self) -> str:
        parts = []
        for pod in self.pods():
            name = pod["metadata"]["name"]
            text = self.cluster.pod_log(self.namespace, name)
            parts.append(f"--- operator pod {name} ({pod['status'].get('phase')})\n{text[-3000:]}")
        return "\n".join(parts)

    def lease(self) -> dict[str, Any] | None:
        return self.cluster.api.get_or_none(
            f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.fullname}")

    def leader_pod(self) -> str | None:
        lease = self.lease()
        holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
        return str(holder).rsplit("_", 1)[0] if holder else None


@pytest.fixture
def release(cluster: Cluster) -> Iterator[Release]:
    installed = Release(cluster, cluster.create_namespace("ops"))
    try:
        yield installed
    finally:
        if installed.installed:
            cluster.helm("uninstall", installed.name, "--namespace", installed.namespace,
                         "--wait", "--timeout=60s", check=False)
        cluster.delete_namespace(installed.namespace)


def describe(cluster: Cluster, ns: str, release: Release) -> Callable[[str], str]:
    def context(name: str = "") -> str:
        pods = cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        jobs = cluster.kubectl("get", "rtj", "-n", ns, "-o", "yaml", check=False).stdout
        return f"--- pods\n{pods}\n--- jobs\n{jobs[-5000:]}\n{release.logs()}"

    return context


def finish(cluster: Cluster, ns: str, name: str, context: Callable[[], str],
           timeout: float = 300) -> dict[str, Any]:
    wait_for(f"{name} to finish", lambda: status(cluster, ns, name).get("state")
             in ("Succeeded", "Failed"), timeout=timeout, interval=2, context=context)
    final = status(cluster, ns, name)
    assert final["state"] == "Succeeded", context()
    return final


def delete_jobs(cluster: Cluster, ns: str) -> None:
    """While the operator still runs: it removes the finalizers, so the namespace can go."""
    cluster.kubectl("delete", "resilienttrainingjobs", "--all", "-n", ns, "--timeout=60s",
                    check=False, timeout=90)


def test_helm_installed_operator_runs_cpu_tiny_under_its_cluster_scoped_rbac(
    cluster: Cluster, namespace: str, release: Release,
) -> None:
    """Issue 13's bar: cpu-tiny Succeeds in a namespace that enforces Pod Security `restricted`,
    with the operator installed by helm and running as the chart's pod."""
    release.install("--set", "replicaCount=1")
    ns = namespace
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
                    "--overwrite")
    context = describe(cluster, ns, release)
    cluster.kubectl("apply", "--server-side", "-n", ns, "-f", str(EXAMPLE))
    try:
        # Two trainer pods on two p5 nodes, each running the trainer under ft_launcher.
        trainers = wait_for("both trainer pods running", lambda: (
            p if len(p := pods_by_role(cluster, ns, "trainer")) == 2
            and all(x["status"].get("phase") == "Running" for x in p.values()) else None),
            timeout=180, context=lambda: context())
        nodes = {p["spec"]["nodeName"] for p in trainers.values()}
        assert len(nodes) == 2 and all(n.startswith("p5-node-") for n in nodes), nodes
        command = trainers["cpu-tiny-0"]["spec"]["containers"][0]["command"]
        assert command[:3] == ["python", "-m", "rtj_trainer.launcher"] and "--nnodes=2" in command
        steps_seen: list[int] = []

        def finished() -> bool:
            step = printed_step(cluster, ns, "cpu-tiny")
            if step is not None and (not steps_seen or steps_seen[-1] != step):
                steps_seen.append(step)
            return status(cluster, ns, "cpu-tiny").get("state") in ("Succeeded", "Failed")

        wait_for("cpu-tiny to finish", finished, timeout=420, interval=2,
                 context=lambda: context())
        final = status(cluster, ns, "cpu-tiny")
        assert final["state"] == "Succeeded", context()
        # The trainer's own final step and commit (its termination message), not a stale scrape.
        assert final["step"] == 80 and final["lastCheckpoint"]["step"] == 80, final
        # `kubectl get rtj` shows the step while the job runs, not only at the end: a value
        # strictly between the start and the last step, then the last step. (How many values a
        # 2 s poll sees depends on the host's load.)
        assert [s for s in steps_seen if 0 < s < 80] and steps_seen[-1] == 80, steps_seen
        assert summary(cluster, ns, "cpu-tiny-0")["steps"] == 80
        # The SIGKILL of rank 1 at step 35 was handled by ft_launcher inside the pods.
        assert final["restarts"]["launcher"] >= 1, final["restarts"]
        actions = [i["action"] for i in final["incidents"]]
        assert "RankRestart" in actions, final["incidents"]  # the pod-killing fault at step 55
        assert not [c for c in final["conditions"]
                    if c["type"] == "AdmissionRefused" and c["status"] == "True"], final
        # The operator is the chart's pod, authenticated as the chart's ServiceAccount.
        (pod,) = release.pods()
        assert pod["spec"]["serviceAccountName"] == release.fullname
        log = cluster.pod_log(release.namespace, pod["metadata"]["name"])
        assert "leading: Lease" in log
    finally:
        delete_jobs(cluster, ns)


@pytest.mark.long
def test_namespaced_install_serves_its_namespace_and_ignores_the_others(
    cluster: Cluster, namespace: str, release: Release,
) -> None:
    # The release namespace is the one it serves (rbac.clusterScoped=false: Roles there only).
    release.install("--set", "rbac.clusterScoped=false", "--set", "replicaCount=1",
                    "--set", "leaderElection.enabled=false")
    served, other = release.namespace, namespace
    context = describe(cluster, served, release)
    apply(cluster, other, cpu_tiny("elsewhere", steps=20, faults=None))
    apply(cluster, served, cpu_tiny("here", steps=20, faults=None))
    try:
        finish(cluster, served, "here", lambda: context(), timeout=240)
        ignored = json.loads(cluster.kubectl("get", "rtj", "elsewhere", "-n", other,
                                             "-o", "json").stdout)
        assert not ignored.get("status"), ignored
        assert not ignored["metadata"].get("finalizers"), ignored
        assert not any(k.startswith(GROUP) for k in ignored["metadata"].get("annotations", {}))
        assert cluster.api.get(f"/api/v1/namespaces/{other}/pods")["items"] == []
    finally:
        delete_jobs(cluster, served)
        cluster.kubectl("delete", "rtj", "elsewhere", "-n", other, "--wait=false", check=False)


class PodRecorder:
    """Every trainer pod UID the API server reports from now on (a watch sees each one, however
    short-lived, where polling could miss one)."""

    def __init__(self, cluster: Cluster, ns: str) -> None:
        path = f"/api/v1/namespaces/{ns}/pods"
        listed = cluster.api.get(path)
        self.uids: dict[str, set[str]] = {}
        for pod in listed["items"]:
            self._add(pod)
        self.stop = threading.Event()

        def run() -> None:
            version = listed["metadata"]["resourceVersion"]
            while not self.stop.is_set():
                for event in cluster.api.watch(path, version, timeout_seconds=5):
                    pod = event["object"]
                    version = pod["metadata"].get("resourceVersion", version)
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._add(pod)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def _add(self, pod: dict[str, Any]) -> None:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(f"{GROUP}/role") == "trainer":
            self.uids.setdefault(pod["metadata"]["name"], set()).add(pod["metadata"]["uid"])


@pytest.mark.long
def test_two_replicas_the_leader_killed_mid_recovery_the_follower_finishes_it_once(
    cluster: Cluster, namespace: str, release: Release,
) -> None:
    release.install("--set", "replicaCount=2",
                    "--set", "leaderElection.leaseDurationSeconds=6",
                    "--set", "leaderElection.renewDeadlineSeconds=4",
                    "--set", "leaderElection.retryPeriodSeconds=1")
    ns, name = namespace, "ha"
    context = describe(cluster, ns, release)
    apply(cluster, ns, cpu_tiny(name, steps=120, faults=None))
    try:
        wait_for("a committed checkpoint", lambda: (
            (status(cluster, ns, name).get("lastCheckpoint") or {}).get("step", 0) >= 20),
            timeout=240, context=lambda: context())
        assert len(release.pods()) == 2
        leader = release.leader_pod()
        assert leader in {p["metadata"]["name"] for p in release.pods()}
        recorder = PodRecorder(cluster, ns)
        victim = f"{name}-1"
        before = pods_by_role(cluster, ns, "trainer")[victim]["metadata"]["uid"]

        cluster.nodes.kill_pod(ns, victim)  # the trainer pod dies (SIGKILL, Failed)
        # The leader acts (deletes the failed pod, then writes the incident): kill it then.
        path = f"/api/v1/namespaces/{ns}/pods/{victim}"
        deadline = time.monotonic() + 60
        while True:
            pod = cluster.api.get_or_none(path)
            if pod is None or pod["metadata"].get("deletionTimestamp") \
                    or pod["metadata"]["uid"] != before:
                break
            assert time.monotonic() < deadline, context()
            time.sleep(0.05)
        killed_at = time.monotonic()
        cluster.nodes.kill_pod(release.namespace, leader, sig=9)

        new_leader = wait_for("another replica to take the Lease", lambda: (
            (holder := release.leader_pod()) and holder != leader and holder),
            timeout=30, interval=0.2, context=lambda: context())
        takeover = time.monotonic() - killed_at
        assert takeover < 6 + 1 + 3, f"took {takeover:.1f} s"  # duration + retry + slack
        final = finish(cluster, ns, name, lambda: context(), timeout=300)
        recorder.stop.set()

        assert final["step"] >= 110
        assert {p: len(u) for p, u in recorder.uids.items()} == {f"{name}-0": 1, victim: 2}, \
            recorder.uids
        rank_restarts = [i for i in final["incidents"] if i["action"] == "RankRestart"]
        assert len(rank_restarts) == 1, final["incidents"]
        assert rank_restarts[0]["nodeIndex"] == 1
        assert final["restarts"]["rank"] == 1 and final["restarts"]["full"] == 0
        assert len(final["restartRecords"]["rank"]) == 1, final["restartRecords"]
        assert release.lease()["spec"]["leaseTransitions"] >= 1  # type: ignore[index]
        assert new_leader != leader
    finally:
        delete_jobs(cluster, ns)
