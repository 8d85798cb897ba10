"""The local cluster runs pods like the Kubernetes the operator will meet: lifecycle and faults.

Everything here goes through the real kube-apiserver; pods are bound by the real kube-scheduler
and run as processes on the harness's process-backed nodes; garbage collection and PV binding are
done by the real kube-controller-manager. The node-only checks are in
tests/integration/test_cluster.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from harness.cluster import Cluster
from harness.procs import wait_for

pytestmark = pytest.mark.e2e

JsonObject = dict[str, Any]


def pod_manifest(
    name: str,
    command: list[str],
    *,
    labels: dict[str, str] | None = None,
    owner: JsonObject | None = None,
    env: list[JsonObject] | None = None,
    volumes: list[JsonObject] | None = None,
    mounts: list[JsonObject] | None = None,
    **spec: Any,
) -> JsonObject:
    container: JsonObject = {"name": "main", "image": "ignored:latest", "command": command}
    if env:
        container["env"] = env
    if mounts:
        container["volumeMounts"] = mounts
    metadata: JsonObject = {"name": name, "labels": labels or {}}
    if owner is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 10,
            "containers": [container],
            "volumes": volumes or [],
            **spec,
        },
    }


def create_pod(cluster: Cluster, namespace: str, manifest: JsonObject) -> JsonObject:
    return cluster.api.create(f"/api/v1/namespaces/{namespace}/pods", manifest)


def wait_for_pgid(cluster: Cluster, namespace: str, name: str) -> int:
    """The host process group of a running pod, from the harness's annotation."""
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    pgid = wait_for(
        lambda: cluster.api.get(path)["metadata"].get("annotations", {}).get("harness.local/pgid"),
        30,
        "the pgid annotation",
    )
    return int(pgid)


def test_a_pod_runs_reports_its_exit_code_and_is_garbage_collected_with_its_owner(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    owner = cluster.api.create(
        f"/api/v1/namespaces/{namespace}/configmaps",
        {"metadata": {"name": "owner"}, "data": {"greeting": "hello"}},
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    manifest = pod_manifest(
        "exits-seven",
        ["sh", "-c", 'echo "$(GREETING) from $(POD_NAME)"; echo proof > /out/written; exit 7'],
        owner=owner,
        env=[
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "GREETING",
                "valueFrom": {"configMapKeyRef": {"name": "owner", "key": "greeting"}},
            },
        ],
        volumes=[{"name": "out", "hostPath": {"path": str(out_dir)}}],
        mounts=[{"name": "out", "mountPath": "/out"}],
    )
    manifest["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}
    }
    create_pod(cluster, namespace, manifest)

    pod = cluster.wait_for_pod(namespace, "exits-seven", phases=("Failed", "Succeeded"))

    assert pod["status"]["phase"] == "Failed"
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 7
    assert terminated["reason"] == "Error"
    assert pod["spec"]["nodeName"] in cluster.nodes.node_names()
    assert pod["status"]["podIP"].startswith("127.") and pod["status"]["podIP"] != "127.0.0.1"
    assert "hello from exits-seven" in cluster.pod_log(namespace, "exits-seven")
    assert (out_dir / "written").read_text() == "proof\n"

    cluster.api.delete(f"/api/v1/namespaces/{namespace}/configmaps/owner")
    cluster.wait_for_pod_gone(namespace, "exits-seven", timeout=60)


def test_a_pod_sees_its_hostname_loopback_ip_and_service_names(
    cluster: Cluster, namespace: str
) -> None:
    script = """
import json, os, socket, sys, time
names = {
    "web": "web",
    "web_fqdn": "web.%(ns)s.svc.cluster.local",
    "member": "member-0.grp.%(ns)s.svc.cluster.local",
    "member_short": "member-0.grp",
}
deadline = time.time() + 30
while True:
    try:
        resolved = {key: socket.gethostbyname(name % {"ns": os.environ["NS"]})
                    for key, name in names.items()}
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.1)
server = socket.socket()
server.bind((os.environ["POD_IP"], 8080))
print(json.dumps({"hostname": socket.gethostname(), "pod_ip": os.environ["POD_IP"],
                  "arg": sys.argv[1], **resolved}))
"""
    create_pod(
        cluster,
        namespace,
        pod_manifest(
            "dns-probe",
            ["python", "-c", script, "ip=$(POD_IP)"],
            labels={"app": "dns-probe"},
            env=[
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            ],
            hostname="member-0",
            subdomain="grp",
        ),
    )
    cluster.wait_for_pod(namespace, "dns-probe", phases=("Running", "Succeeded", "Failed"))
    # Services appear after the pod started: its hosts file must be rewritten in place.
    services = f"/api/v1/namespaces/{namespace}/services"
    selector = {"app": "dns-probe"}
    cluster.api.create(
        services,
        {
            "metadata": {"name": "grp"},
            "spec": {"clusterIP": "None", "selector": selector, "ports": [{"port": 8080}]},
        },
    )
    cluster.api.create(
        services,
        {"metadata": {"name": "web"}, "spec": {"selector": selector, "ports": [{"port": 8080}]}},
    )

    pod = cluster.wait_for_pod(namespace, "dns-probe", phases=("Succeeded", "Failed"), timeout=60)

    log = cluster.pod_log(namespace, "dns-probe")
    assert pod["status"]["phase"] == "Succeeded", log
    seen = json.loads(log.strip().splitlines()[-1])
    pod_ip = pod["status"]["podIP"]
    assert seen["hostname"] == "member-0"
    assert seen["pod_ip"] == pod_ip and seen["arg"] == f"ip={pod_ip}"
    assert pod_ip.startswith("127.") and pod_ip != "127.0.0.1"
    assert seen["web"] == seen["web_fqdn"] == pod_ip
    assert seen["member"] == seen["member_short"] == pod_ip


def test_a_local_shared_pvc_is_bound_and_two_pods_share_its_files(
    cluster: Cluster, namespace: str
) -> None:
    cluster.api.create(
        f"/api/v1/namespaces/{namespace}/persistentvolumeclaims",
        {
            "metadata": {"name": "checkpoints"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "local-shared",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    pvc_path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/checkpoints"
    pvc = wait_for(
        lambda: (p := cluster.api.get(pvc_path))["status"].get("phase") == "Bound" and p,
        60,
        "the PVC to be Bound",
    )
    pv = cluster.api.get(f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
    assert Path(pv["spec"]["hostPath"]["path"]).parent == cluster.shared_dir
    assert pv["spec"]["accessModes"] == ["ReadWriteMany"]

    mount_path = "/rtj-harness-test-checkpoints"
    volume = {"name": "ckpt", "persistentVolumeClaim": {"claimName": "checkpoints"}}
    mount = {"name": "ckpt", "mountPath": mount_path}
    create_pod(
        cluster,
        namespace,
        pod_manifest(
            "writer",
            ["sh", "-c", f"echo shared-data > {mount_path}/hello"],
            volumes=[volume],
            mounts=[mount],
        ),
    )
    assert (
        cluster.wait_for_pod(namespace, "writer", ("Succeeded", "Failed"))["status"]["phase"]
        == "Succeeded"
    ), cluster.pod_log(namespace, "writer")
    create_pod(
        cluster,
        namespace,
        pod_manifest("reader", ["cat", f"{mount_path}/hello"], volumes=[volume], mounts=[mount]),
    )
    reader = cluster.wait_for_pod(namespace, "reader", ("Succeeded", "Failed"))

    assert reader["status"]["phase"] == "Succeeded"
    assert cluster.pod_log(namespace, "reader") == "shared-data\n"
    assert (Path(pv["spec"]["hostPath"]["path"]) / "hello").read_text() == "shared-data\n"
    assert not Path(mount_path).exists(), "the host mount point is removed with the last pod"


def test_freeze_thaw_and_kill_act_on_every_process_of_a_pod(
    cluster: Cluster, namespace: str
) -> None:
    ticker = "import time\nfor i in range(100000):\n    print(i, flush=True)\n    time.sleep(0.02)"
    create_pod(cluster, namespace, pod_manifest("ticker", ["python", "-c", ticker]))
    pgid = wait_for_pgid(cluster, namespace, "ticker")
    assert os.getpgid(pgid) == pgid
    log_path = cluster.pod_log_path(namespace, "ticker")
    wait_for(lambda: log_path.stat().st_size > 0, 30, "the ticker to print")

    cluster.nodes.freeze_pod(namespace, "ticker")
    frozen_size = log_path.stat().st_size
    time.sleep(0.5)
    assert log_path.stat().st_size == frozen_size, "a frozen pod prints nothing"
    cluster.nodes.thaw_pod(namespace, "ticker")
    wait_for(lambda: log_path.stat().st_size > frozen_size, 20, "the thawed pod to print")

    cluster.nodes.kill_pod(namespace, "ticker", sig=9)
    pod = cluster.wait_for_pod(namespace, "ticker", ("Failed", "Succeeded"), timeout=30)
    assert pod["status"]["phase"] == "Failed"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137


def test_deleting_a_running_pod_sends_sigterm_then_removes_it(
    cluster: Cluster, namespace: str
) -> None:
    script = 'trap "echo got TERM; exit 0" TERM; echo started; while true; do sleep 0.1; done'
    create_pod(cluster, namespace, pod_manifest("graceful", ["sh", "-c", script]))
    cluster.wait_for_pod(namespace, "graceful")
    wait_for(lambda: "started" in cluster.pod_log(namespace, "graceful"), 30, "the pod to start")

    cluster.api.delete(f"/api/v1/namespaces/{namespace}/pods/graceful")

    cluster.wait_for_pod_gone(namespace, "graceful", timeout=30)
    assert "got TERM" in cluster.pod_log(namespace, "graceful")


def test_force_deleting_a_pod_kills_its_processes(cluster: Cluster, namespace: str) -> None:
    create_pod(cluster, namespace, pod_manifest("doomed", ["sleep", "300"]))
    pod_path = f"/api/v1/namespaces/{namespace}/pods/doomed"
    pgid = wait_for_pgid(cluster, namespace, "doomed")

    cluster.api.delete(pod_path, {"gracePeriodSeconds": 0})  # gone from the API at once

    def process_gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(process_gone, 30, "the pod's processes to be killed")


def test_containers_of_one_pod_share_empty_dirs_and_restart_on_failure(
    cluster: Cluster, namespace: str
) -> None:
    manifest = pod_manifest(
        "pair",
        ["sh", "-c", "echo from-writer > /scratch/note"],
        volumes=[{"name": "scratch", "emptyDir": {"medium": "Memory"}}],
        mounts=[{"name": "scratch", "mountPath": "/scratch"}],
        restartPolicy="OnFailure",
    )
    # The reader fails on its first run; OnFailure restarts it (the first restart at once).
    first_run_fails = "test -e /scratch/tried || { touch /scratch/tried; exit 3; }"
    manifest["spec"]["containers"].append(
        {
            "name": "reader",
            "image": "ignored",
            "command": ["sh", "-c", f"{first_run_fails}; sleep 0.2; cat /scratch/note"],
            "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
        }
    )
    create_pod(cluster, namespace, manifest)

    pod = cluster.wait_for_pod(namespace, "pair", ("Succeeded", "Failed"), timeout=40)

    assert pod["status"]["phase"] == "Succeeded"
    statuses = {s["name"]: s for s in pod["status"]["containerStatuses"]}
    assert statuses["main"]["state"]["terminated"]["exitCode"] == 0
    assert statuses["reader"]["state"]["terminated"]["exitCode"] == 0
    assert statuses["reader"]["restartCount"] == 1
    assert statuses["reader"]["lastState"]["terminated"]["exitCode"] == 3
    assert cluster.pod_log(namespace, "pair", "reader").endswith("from-writer\n")


def test_the_termination_message_reaches_the_container_status_like_a_kubelet_does(
    cluster: Cluster, namespace: str
) -> None:
    """Per container, the file at terminationMessagePath goes to state.terminated.message;
    `FallbackToLogsOnError` takes the log's tail when the file is empty and the container
    failed; with the default policy (`File`) an empty file leaves no message."""
    script = 'echo noise; printf \'{"outcome":"Failed"}\' > /dev/termination-log; exit 3'
    writes = pod_manifest("writes", ["sh", "-c", script])
    custom = pod_manifest("custom-path", ["sh", "-c", "echo done > /tmp/why; exit 0"])
    custom["spec"]["containers"][0]["terminationMessagePath"] = "/tmp/why"
    fallback = pod_manifest("falls-back", ["sh", "-c", "echo line one; echo last words; exit 5"])
    fallback["spec"]["containers"][0]["terminationMessagePolicy"] = "FallbackToLogsOnError"
    silent = pod_manifest("silent", ["sh", "-c", "echo only a log; exit 5"])
    for manifest in (writes, custom, fallback, silent):
        create_pod(cluster, namespace, manifest)

    def terminated(name: str) -> JsonObject:
        pod = cluster.wait_for_pod(namespace, name, phases=("Failed", "Succeeded"))
        result: JsonObject = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        return result

    assert terminated("writes")["message"] == '{"outcome":"Failed"}'
    assert terminated("writes")["exitCode"] == 3
    assert terminated("custom-path")["message"] == "done\n"
    assert terminated("falls-back")["message"].endswith("line one\nlast words")
    assert "message" not in terminated("silent")
