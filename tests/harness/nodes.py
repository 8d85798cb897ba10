"""Process-backed nodes ("kubelet-lite"): p5.48xlarge-shaped Nodes whose pods are host processes.

One process (`python -m harness.nodes`) plays kubelet for N nodes:

* registers the Node objects (p5.48xlarge capacity and labels), keeps them Ready and renews their
  Leases; a test can mark a node NotReady (heartbeats stop, Ready=False) and Ready again;
* for every pod the real kube-scheduler binds to one of its nodes it allocates a loopback pod IP
  (127.a.b.c), resolves the container env like kubelet, and runs each container's command+args
  as a host process tree (see `podinit`: own mount/UTS namespace, hostname, private /tmp,
  /dev/shm, /etc/hosts, volumes) inside a per-container cgroup. The image is ignored;
* reports pod status (phase, conditions, containerStatuses with exit codes, 128+N for signal N),
  and annotates running pods with `harness.local/pgid`;
* on deletionTimestamp: SIGTERM the process groups, SIGKILL after min(grace, 30 s), then deletes
  the pod with gracePeriodSeconds=0 like kubelet; processes of pods that vanish are killed;
* a tiny provisioner: StorageClass `local-shared` (default class) -> hostPath PVs in a shared dir
  (stands in for FSx, ReadWriteMany);
* DNS stand-in: per-pod hosts files (see `hostsfile`), rewritten in place on changes;
* a control API on 127.0.0.1 (HTTP JSON, client in `harness.control`) for fault injection.

Simplifications (documented for test authors): restartPolicy Always/OnFailure restart a container
in place with kubelet's back-off (at once, then 10 s doubling); init containers, probes and image
entrypoints are not supported (a container without `command` leaves its pod Pending with
CreateContainerError); a NotReady node keeps its processes running (like a network partition);
`kubectl logs` does not work (read `<run_dir>/pods/<ns>_<pod>_<container>.log`); a ClusterIP
Service name resolves to its backing pod's IP, so clients use the target port.

Design: informer threads (pods, services, PVCs) and process-exit waiters only enqueue events; a
single reconcile thread owns all state and makes every decision and API write.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from harness import cgroups
from harness.controlapi import start_control_server
from harness.envvars import EnvResolutionError, expand_command, resolve_container_env
from harness.hostsfile import RunningPod, ServiceEntry, render_hosts
from harness.ipam import LoopbackIpAllocator
from harness.kubeapi import ApiError, JsonObject, KubeApi
from harness.nodestate import (
    ContainerRun,
    NotReadyToStart,
    PodRun,
    exit_code_of,
    node_manifest,
    node_status,
    now_micro,
    now_rfc3339,
    pod_conditions,
    restart_delay,
)

PODINIT = Path(__file__).with_name("podinit.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
PROVISIONER = "harness.local/shared"
STORAGE_CLASS = "local-shared"
LEASE_SECONDS = 40
LEASE_RENEW_SECONDS = 10.0
NODE_STATUS_SECONDS = 30.0
MAX_GRACE_SECONDS = 30.0

# ---------------------------------------------------------------- the kubelet


def log(message: str) -> None:
    print(f"[nodes {datetime.now().strftime('%H:%M:%S.%f')[:-3]}] {message}", flush=True)



def paths_to_keep_visible(work_dir: Path, path_env: str) -> list[Path]:
    """Host paths under /tmp that a pod must still see through its private /tmp.

    Each pod gets a private /tmp (ft_launcher's sockets and the trainers' temp files stay apart;
    a TMPDIR instead would make the unix-socket paths too long). When the run directory or the
    checkout itself lives under /tmp (a CI clone, pytest's basetemp), that would hide the pod's
    working directory (spawned children such as NVRx's checkpoint worker chdir into it by path),
    the project's virtualenv (ft_launcher, nvrx-control, python) and its editable sources; these
    are bound back at their own paths.
    """
    tmp = Path("/tmp")
    wanted = [work_dir.resolve(), REPO_ROOT.resolve()]
    wanted += [Path(p).resolve() for p in path_env.split(os.pathsep) if p and Path(p).is_dir()]
    under_tmp = sorted({p for p in wanted if tmp in p.parents}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in under_tmp:
        if not any(k == path or k in path.parents for k in kept):
            kept.append(path)
    return kept

class Kubelet:
    """Owns all node/pod state; only the reconcile thread touches it."""

    def __init__(
        self, api: KubeApi, run_dir: Path, shared_dir: Path, node_count: int, prefix: str
    ) -> None:
        self.api = api
        self.run_dir = run_dir
        self.shared_dir = shared_dir
        self.logs_dir = run_dir / "pods"
        self.data_dir = run_dir / "pod-data"
        self.ips = LoopbackIpAllocator()
        self.nodes = [f"{prefix}-{i}" for i in range(node_count)]
        self.node_ips = {name: self.ips.node_ip(i) for i, name in enumerate(self.nodes)}
        self.node_ready = {name: True for name in self.nodes}
        self.node_transition = {name: now_rfc3339() for name in self.nodes}
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.pods: dict[tuple[str, str], JsonObject] = {}
        self.services: dict[tuple[str, str], JsonObject] = {}
        self.runs: dict[str, PodRun] = {}
        self.waiting: dict[str, str] = {}
        self.done: set[str] = set()
        self.delete_requested: set[str] = set()
        self.provisioned: dict[str, tuple[str, Path]] = {}
        self.mountpoint_refs: Counter[Path] = Counter()
        self.cgroups = cgroups.CgroupTree.create(f"rtj-harness-{os.getpid()}")
        self.stopping = threading.Event()
        self.control_url = ""
        self._last_lease = 0.0
        self._last_node_status = 0.0

    # ------------------------------------------------------------ startup / main loop

    def run(self, state_file: Path) -> None:
        for directory in (self.logs_dir, self.data_dir, self.shared_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.register_nodes()
        self.ensure_storage_class()
        for kind, path in (
            ("pod", "/api/v1/pods"),
            ("service", "/api/v1/services"),
            ("pvc", "/api/v1/persistentvolumeclaims"),
        ):
            threading.Thread(target=self.informer, args=(kind, path), daemon=True).start()
        self.control_url = start_control_server(self)
        state = {
            "pid": os.getpid(),
            "control_url": self.control_url,
            "nodes": self.nodes,
            "cgroup": str(self.cgroups.base) if self.cgroups else None,
        }
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.rename(state_file)
        log(
            f"serving {len(self.nodes)} nodes; control API {self.control_url}; cgroups "
            f"{self.cgroups.base if self.cgroups else 'unavailable (process groups only)'}"
        )
        last_tick = 0.0
        while not self.stopping.is_set():
            try:
                event = self.events.get(timeout=0.25)
            except queue.Empty:
                event = None
            try:
                if event is not None:
                    self.handle(event)
                if time.monotonic() - last_tick >= 0.5:
                    last_tick = time.monotonic()
                    self.tick()
            except Exception:
                log(f"error handling {event[:2] if event else 'tick'}:\n{traceback.format_exc()}")
        self.shutdown()

    def handle(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "call":
            _, function, reply = event
            try:
                reply.put((True, function()))
            except Exception as error:
                reply.put((False, f"{type(error).__name__}: {error}"))
        elif kind == "exit":
            self.on_exit(event[1], event[2], event[3])
        elif kind == "sync":
            self.on_sync(event[1], event[2])
        elif kind == "pod":
            self.on_pod(event[1], event[2])
        elif kind == "service":
            self.on_service(event[1], event[2])
        elif kind == "pvc":
            self.on_pvc(event[1], event[2])

    def informer(self, kind: str, path: str) -> None:
        """List, then watch from the list's resourceVersion; relist on errors."""
        while not self.stopping.is_set():
            try:
                listing = self.api.get(path)
                version = listing["metadata"]["resourceVersion"]
                self.events.put(("sync", kind, listing["items"]))
                while not self.stopping.is_set():
                    for event in self.api.watch(path, version):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise RuntimeError(f"watch error: {obj.get('message')}")
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self.events.put((kind, event["type"], obj))
            except Exception as error:
                if not self.stopping.is_set():
                    log(f"{kind} informer: {error}; relisting")
                    time.sleep(1)

    def on_sync(self, kind: str, items: list[JsonObject]) -> None:
        keyed = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in items}
        if kind == "pod":
            live_uids = {o["metadata"]["uid"] for o in items}
            for uid in [u for u in self.runs if u not in live_uids]:
                self.pod_vanished(uid)
            self.pods = keyed
            for pod in items:
                self.reconcile(pod)
        elif kind == "service":
            self.services = keyed
        elif kind == "pvc":
            for pvc in items:
                self.on_pvc("ADDED", pvc)
        self.refresh_hosts()

    def tick(self) -> None:
        now = time.monotonic()
        for run in list(self.runs.values()):
            self.restart_due_containers(run)
            if run.kill_deadline is not None and now >= run.kill_deadline and run.alive:
                log(f"{run.namespace}/{run.name}: grace period over, SIGKILL")
                self.signal_pod(run, signal.SIGKILL)
                run.kill_deadline = None
        for uid in list(self.waiting):
            pod = self.pod_by_uid(uid)
            if pod is None:
                self.waiting.pop(uid, None)
            else:
                self.reconcile(pod)
        if now - self._last_lease >= LEASE_RENEW_SECONDS:
            self._last_lease = now
            for node in self.nodes:
                if self.node_ready[node]:
                    self.renew_lease(node)
        if now - self._last_node_status >= NODE_STATUS_SECONDS:
            self._last_node_status = now
            for node in self.nodes:
                if self.node_ready[node]:
                    self.post_node_status(node)

    # ------------------------------------------------------------ nodes

    def register_nodes(self) -> None:
        for index, name in enumerate(self.nodes):
            manifest = node_manifest(name, index)
            try:
                self.api.create("/api/v1/nodes", manifest)
            except ApiError as error:
                if error.status != 409:
                    raise
                self.api.patch(f"/api/v1/nodes/{name}", {"metadata": manifest["metadata"]})
            self.post_node_status(name)
            self.renew_lease(name)

    def post_node_status(self, name: str) -> None:
        status = node_status(
            name, self.node_ips[name], self.node_ready[name], self.node_transition[name]
        )
        self.api.patch(f"/api/v1/nodes/{name}/status", {"status": status})

    def renew_lease(self, name: str) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        spec = {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": now_micro(),
        }
        try:
            self.api.patch(path, {"spec": spec})
        except ApiError as error:
            if error.status != 404:
                raise
            lease = {"metadata": {"name": name, "namespace": "kube-node-lease"}, "spec": spec}
            self.api.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

    def set_node_ready(self, name: str, ready: bool) -> JsonObject:
        if name not in self.node_ready:
            raise KeyError(f"no harness node {name!r}")
        if self.node_ready[name] != ready:
            self.node_transition[name] = now_rfc3339()
        self.node_ready[name] = ready
        self.post_node_status(name)
        if ready:
            self.renew_lease(name)
        return {"node": name, "ready": ready}

    # ------------------------------------------------------------ storage

    def ensure_storage_class(self) -> None:
        storage_class = {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": PROVISIONER,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        }
        try:
            self.api.create("/apis/storage.k8s.io/v1/storageclasses", storage_class)
        except ApiError as error:
            if error.status != 409:
                raise

    def class_is_ours(self, name: str | None) -> bool:
        if not name:
            return False
        if name == STORAGE_CLASS:
            return True
        found = self.api.get_or_none(f"/apis/storage.k8s.io/v1/storageclasses/{name}")
        return found is not None and found.get("provisioner") == PROVISIONER

    def on_pvc(self, event_type: str, pvc: JsonObject) -> None:
        meta, spec = pvc["metadata"], pvc.get("spec", {})
        uid = meta["uid"]
        if event_type == "DELETED":
            if uid in self.provisioned:
                pv_name, path = self.provisioned.pop(uid)
                self.api.delete(f"/api/v1/persistentvolumes/{pv_name}")
                shutil.rmtree(path, ignore_errors=True)
                log(f"deleted PV {pv_name} of PVC {meta['namespace']}/{meta['name']}")
            return
        if spec.get("volumeName") or uid in self.provisioned:
            return
        if pvc.get("status", {}).get("phase") != "Pending":
            return
        if not self.class_is_ours(spec.get("storageClassName")):
            return
        path = self.shared_dir / f"{meta['namespace']}-{meta['name']}-{uid[:8]}"
        path.mkdir(parents=True, exist_ok=True)
        pv_name = f"pvc-{uid}"
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": pv_name,
                "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
            },
            "spec": {
                "capacity": {"storage": spec["resources"]["requests"]["storage"]},
                "accessModes": spec.get("accessModes", ["ReadWriteOnce"]),
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": spec["storageClassName"],
                "volumeMode": spec.get("volumeMode", "Filesystem"),
                "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                "claimRef": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": uid,
                },
            },
        }
        try:
            self.api.create("/api/v1/persistentvolumes", pv)
        except ApiError as error:
            if error.status != 409:
                raise
        self.provisioned[uid] = (pv_name, path)
        log(f"provisioned PV {pv_name} at {path} for PVC {meta['namespace']}/{meta['name']}")

    # ------------------------------------------------------------ pods: events

    def pod_by_uid(self, uid: str) -> JsonObject | None:
        return next((p for p in self.pods.values() if p["metadata"]["uid"] == uid), None)

    def on_pod(self, event_type: str, pod: JsonObject) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        if event_type == "DELETED":
            if self.pods.get(key, {}).get("metadata", {}).get("uid") == meta["uid"]:
                del self.pods[key]
            self.pod_vanished(meta["uid"])
        else:
            self.pods[key] = pod
            self.reconcile(pod)
        self.refresh_hosts()

    def on_service(self, event_type: str, service: JsonObject) -> None:
        key = (service["metadata"]["namespace"], service["metadata"]["name"])
        if event_type == "DELETED":
            self.services.pop(key, None)
        else:
            self.services[key] = service
        self.refresh_hosts()

    def reconcile(self, pod: JsonObject) -> None:
        """Decide what a pod bound to one of our nodes needs: start, terminate, or nothing."""
        meta, spec = pod["metadata"], pod.get("spec", {})
        if spec.get("nodeName") not in self.node_ready:
            return
        uid = meta["uid"]
        run = self.runs.get(uid)
        if meta.get("deletionTimestamp"):
            self.waiting.pop(uid, None)
            if run is not None:
                for container in run.containers.values():
                    container.restart_at = None
            if run is not None and not run.alive and not run.cleaned:
                self.finish_run(run)
            if run is not None and run.alive:
                if run.kill_deadline is None:
                    grace = meta.get("deletionGracePeriodSeconds")
                    if grace is None:
                        grace = spec.get("terminationGracePeriodSeconds", 30)
                    grace = min(float(grace), MAX_GRACE_SECONDS)
                    log(
                        f"{meta['namespace']}/{meta['name']}: deleting, SIGTERM (grace {grace:g} s)"
                    )
                    run.kill_deadline = time.monotonic() + grace
                    for container in run.containers.values():
                        if container.running:
                            os_killpg(container.popen.pid, signal.SIGTERM)
            else:
                self.finish_deletion(pod)
            return
        if run is not None or uid in self.done:
            return
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return
        self.start_pod(pod)

    def finish_deletion(self, pod: JsonObject) -> None:
        uid = pod["metadata"]["uid"]
        if uid in self.delete_requested:
            return
        self.delete_requested.add(uid)
        self.api.delete(pod_path(pod), {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})

    def pod_vanished(self, uid: str) -> None:
        self.waiting.pop(uid, None)
        self.delete_requested.discard(uid)
        self.done.discard(uid)
        run = self.runs.get(uid)
        if run is None:
            return
        run.vanished = True
        for container in run.containers.values():
            container.restart_at = None
        if run.alive:
            log(f"{run.namespace}/{run.name} vanished from the API: killing its processes")
            self.signal_pod(run, signal.SIGKILL)
        else:
            self.cleanup(run)
            del self.runs[uid]

    def on_exit(self, uid: str, container_name: str, pid: int) -> None:
        run = self.runs.get(uid)
        if run is None or run.containers[container_name].popen.pid != pid:
            return
        container = run.containers[container_name]
        returncode = container.popen.wait()
        container.exit_code = exit_code_of(returncode)
        container.finished_at = now_rfc3339()
        if container.cgroup is not None:
            cgroups.signal_all(container.cgroup, signal.SIGKILL)  # the container's leftovers
        log(f"{run.namespace}/{run.name}/{container_name} exited with {container.exit_code}")
        if self.should_restart(run, container):
            container.last_terminated = container.terminated_state()
            container.restart_at = time.monotonic() + restart_delay(container.restart_count)
        if run.alive:
            self.report_status(run)
            return
        if run.vanished:
            self.cleanup(run)
            del self.runs[uid]
            return
        self.finish_run(run)
        pod = self.pod_by_uid(uid)
        if pod is not None and pod["metadata"].get("deletionTimestamp"):
            self.finish_deletion(pod)
        self.refresh_hosts()

    def should_restart(self, run: PodRun, container: ContainerRun) -> bool:
        pod = self.pod_by_uid(run.uid)
        if run.vanished or run.kill_deadline is not None or pod is None:
            return False
        if pod["metadata"].get("deletionTimestamp"):
            return False
        return run.restart_policy == "Always" or (
            run.restart_policy == "OnFailure" and container.exit_code != 0
        )

    def finish_run(self, run: PodRun) -> None:
        """All containers are done for good: release resources and report the final phase."""
        self.cleanup(run)
        self.done.add(run.uid)
        self.report_status(run)

    # ------------------------------------------------------------ pods: starting

    def start_pod(self, pod: JsonObject) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        no_command = [c["name"] for c in spec["containers"] if not c.get("command")]
        if no_command:  # permanent: the pod stays Pending (no crash loop, no churn)
            message = f"harness nodes run only explicit commands; none for {no_command}"
            log(f"{meta['namespace']}/{meta['name']}: {message}")
            self.report_waiting(pod, NotReadyToStart("CreateContainerError", message))
            self.done.add(uid)
            return
        ip = self.ips.allocate()
        node = spec["nodeName"]
        pod_dir = self.data_dir / uid
        try:
            for sub in ("tmp", "shm", "work", "volumes"):
                (pod_dir / sub).mkdir(parents=True, exist_ok=True)
            (pod_dir / "tmp").chmod(0o1777)
            (pod_dir / "shm").chmod(0o1777)
            volumes = self.volume_sources(pod, pod_dir)
            hostname = (spec.get("hostname") or meta["name"])[:63]
            plans = [
                self.container_plan(pod, container, volumes, pod_dir, ip, self.node_ips[node])
                for container in spec["containers"]
            ]
        except NotReadyToStart as waiting:
            self.ips.release(ip)
            if self.waiting.get(uid) != waiting.message:
                self.waiting[uid] = waiting.message
                log(f"{meta['namespace']}/{meta['name']}: waiting: {waiting.message}")
                self.report_waiting(pod, waiting)
            return
        except Exception:
            self.ips.release(ip)
            raise
        self.waiting.pop(uid, None)
        run = PodRun(
            uid=uid,
            namespace=meta["namespace"],
            name=meta["name"],
            node=node,
            ip=ip,
            host_ip=self.node_ips[node],
            hostname=hostname,
            hostname_is_explicit=bool(spec.get("hostname")),
            subdomain=spec.get("subdomain"),
            restart_policy=spec.get("restartPolicy", "Always"),
            pod_dir=pod_dir,
            hosts_file=pod_dir / "hosts",
            start_time=now_rfc3339(),
            cgroup=self.cgroups.pod(uid) if self.cgroups else None,
        )
        run.hosts_text = self.render_hosts_for(run)
        run.hosts_file.write_text(run.hosts_text)
        targets = {plan["target"] for c in plans for plan in c["mounts_plan"]}
        run.host_mountpoints = self.create_host_mountpoints(targets)
        self.runs[uid] = run
        for container, plan in zip(spec["containers"], plans, strict=True):
            self.spawn(run, container, plan)
        log(f"{run.namespace}/{run.name} running on {node} as {ip} (pgids {run.pgids()})")
        self.report_status(run)
        self.annotate(run)
        self.refresh_hosts()

    def volume_sources(self, pod: JsonObject, pod_dir: Path) -> dict[str, Path]:
        """Host directory (or file) backing each pod volume."""
        namespace = pod["metadata"]["namespace"]
        sources: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes", []) or []:
            name = volume["name"]
            local = pod_dir / "volumes" / name
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                pvc = self.api.get_or_none(
                    f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}"
                )
                if pvc is None or pvc.get("status", {}).get("phase") != "Bound":
                    raise NotReadyToStart("ContainerCreating", f"PVC {claim} is not bound yet")
                pv = self.api.get(f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
                pv_spec = pv["spec"]
                path = (pv_spec.get("hostPath") or pv_spec.get("local") or {}).get("path")
                if not path:
                    raise NotReadyToStart("ContainerCreating", f"PV of {claim} has no host path")
                sources[name] = Path(path)
                sources[name].mkdir(parents=True, exist_ok=True)
            elif "hostPath" in volume:
                sources[name] = Path(volume["hostPath"]["path"])
                if volume["hostPath"].get("type", "") in ("", "DirectoryOrCreate"):
                    sources[name].mkdir(parents=True, exist_ok=True)
            elif "configMap" in volume or "secret" in volume:
                local.mkdir(parents=True, exist_ok=True)
                self.write_key_files(namespace, volume, local)
                sources[name] = local
            else:  # emptyDir (any medium) and anything unsupported: a per-pod directory
                local.mkdir(parents=True, exist_ok=True)
                local.chmod(0o1777)
                sources[name] = local
        return sources

    def write_key_files(self, namespace: str, volume: JsonObject, target: Path) -> None:
        if "configMap" in volume:
            ref, name = volume["configMap"], volume["configMap"]["name"]
            obj = self.api.get_or_none(f"/api/v1/namespaces/{namespace}/configmaps/{name}")
            data = dict((obj or {}).get("data", {}) or {})
        else:
            ref, name = volume["secret"], volume["secret"]["secretName"]
            obj = self.api.get_or_none(f"/api/v1/namespaces/{namespace}/secrets/{name}")
            raw = (obj or {}).get("data", {}) or {}
            data = {k: base64.b64decode(v).decode(errors="replace") for k, v in raw.items()}
        if obj is None and not ref.get("optional", False):
            raise NotReadyToStart("ContainerCreating", f"{name} for volume not found")
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            if item["key"] in data:
                file = target / item["path"]
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_text(data[item["key"]])

    def lookup_key(self, namespace: str, kind: str) -> Callable[[str, str], str | None]:
        def lookup(name: str, key: str) -> str | None:
            obj = self.api.get_or_none(f"/api/v1/namespaces/{namespace}/{kind}/{name}")
            if obj is None:
                return None
            data = dict(obj.get("data", {}) or {})
            if kind == "secrets":
                data = {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
            if key == "":
                return json.dumps(data)
            return data.get(key)

        return lookup

    def container_plan(
        self,
        pod: JsonObject,
        container: JsonObject,
        volumes: dict[str, Path],
        pod_dir: Path,
        ip: str,
        host_ip: str,
    ) -> JsonObject:
        namespace = pod["metadata"]["namespace"]
        try:
            container_env = resolve_container_env(
                pod,
                container,
                pod_ip=ip,
                host_ip=host_ip,
                config_map_key=self.lookup_key(namespace, "configmaps"),
                secret_key=self.lookup_key(namespace, "secrets"),
            )
        except EnvResolutionError as error:
            raise NotReadyToStart("CreateContainerConfigError", str(error)) from error
        hostname = (pod["spec"].get("hostname") or pod["metadata"]["name"])[:63]
        env = {**os.environ, "HOSTNAME": hostname, **container_env}
        mounts: dict[str, tuple[str, bool]] = {
            "/dev/shm": (str(pod_dir / "shm"), False),
            "/etc/hosts": (str(pod_dir / "hosts"), False),
        }
        mounts["/tmp"] = (str(pod_dir / "tmp"), False)
        for keep in paths_to_keep_visible(pod_dir / "work", env.get("PATH", "")):
            mounts[str(keep)] = (str(keep), False)
        for mount in container.get("volumeMounts", []) or []:
            if mount["name"] not in volumes:
                raise NotReadyToStart("CreateContainerConfigError", f"no volume {mount['name']}")
            source = volumes[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = (str(source), bool(mount.get("readOnly", False)))
        return {
            "argv": expand_command(container.get("command"), container.get("args"), container_env),
            "env": env,
            "hostname": hostname,
            "pod_dir": str(pod_dir / "work"),
            "working_dir": container.get("workingDir") or None,
            "mounts": [[source, target, ro] for target, (source, ro) in mounts.items()],
            "mounts_plan": [{"target": target} for target in mounts],
        }

    def create_host_mountpoints(self, targets: set[str]) -> list[Path]:
        """Create missing mount points on the host (not under /tmp, /dev, /etc); count users.

        A directory the harness created is removed when its last user pod is gone; it must not
        be removed earlier, as that would detach the mount in the pods still using it.
        """
        owned: list[Path] = []
        for target in sorted(targets):
            path = Path(target)
            if path.parts[:2] in (("/", "tmp"), ("/", "dev"), ("/", "etc")):
                continue
            for directory in [*reversed(path.parents), path]:
                if not directory.exists():
                    directory.mkdir()
                    self.mountpoint_refs[directory] = 0
                if directory in self.mountpoint_refs and directory not in owned:
                    owned.append(directory)
        for directory in owned:
            self.mountpoint_refs[directory] += 1
        return owned

    def release_host_mountpoints(self, paths: list[Path]) -> None:
        for directory in sorted(paths, key=lambda p: len(p.parts), reverse=True):
            self.mountpoint_refs[directory] -= 1
            if self.mountpoint_refs[directory] <= 0:
                del self.mountpoint_refs[directory]
                if mounted_in_any_namespace(directory):
                    continue  # another cluster's pod uses it; removing would detach its mount
                try:
                    directory.rmdir()
                except OSError:
                    pass

    def spawn(self, run: PodRun, container: JsonObject, plan: JsonObject) -> None:
        name = container["name"]
        cgroup = self.cgroups.container(run.uid, name) if self.cgroups else None
        spec = {**plan, "cgroup_procs": str(cgroup / "cgroup.procs") if cgroup else None}
        spec_file = run.pod_dir / f"init-{name}.json"
        spec_file.write_text(json.dumps(spec))
        log_file = self.logs_dir / f"{run.namespace}_{run.name}_{name}.log"
        if log_file.exists():  # an earlier pod with the same name: keep its log aside
            previous = self.logs_dir / "previous"
            previous.mkdir(exist_ok=True)
            log_file.rename(previous / f"{log_file.stem}.{int(time.time() * 1000)}.log")
        run.containers[name] = ContainerRun(
            name=name,
            image=container.get("image", ""),
            popen=self.launch(run, name, spec_file, log_file),
            started_at=now_rfc3339(),
            cgroup=cgroup,
            spec_file=spec_file,
            log_file=log_file,
        )

    def launch(
        self, run: PodRun, name: str, spec_file: Path, log_file: Path
    ) -> subprocess.Popen[bytes]:
        """Start podinit (which execs the command) and a thread that reports its exit."""
        with open(log_file, "ab") as output:
            popen = subprocess.Popen(
                [sys.executable, "-S", str(PODINIT), str(spec_file)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=run.pod_dir,
            )

        def wait_for_exit() -> None:
            popen.wait()
            self.events.put(("exit", run.uid, name, popen.pid))

        threading.Thread(target=wait_for_exit, daemon=True).start()
        return popen

    def restart_due_containers(self, run: PodRun) -> None:
        for container in run.containers.values():
            if container.restart_at is None or time.monotonic() < container.restart_at:
                continue
            container.restart_at = None
            container.restart_count += 1
            container.exit_code = container.finished_at = None
            container.started_at = now_rfc3339()
            container.popen = self.launch(
                run, container.name, container.spec_file, container.log_file
            )
            log(
                f"{run.namespace}/{run.name}/{container.name} restarted ({container.restart_count})"
            )
            self.report_status(run)
            self.annotate(run)

    def annotate(self, run: PodRun) -> None:
        """Record the host process group(s) and cgroup on the pod, for tests and debugging."""
        pgids = run.pgids()
        annotations = {"harness.local/pgid": str(next(iter(pgids.values())))}
        if len(pgids) > 1:
            annotations["harness.local/pgids"] = json.dumps(pgids)
        if run.cgroup is not None:
            annotations["harness.local/cgroup"] = str(run.cgroup)
        path = f"/api/v1/namespaces/{run.namespace}/pods/{run.name}"
        try:
            self.api.patch(path, {"metadata": {"annotations": annotations}})
        except ApiError as error:
            if error.status != 404:
                raise

    # ------------------------------------------------------------ pods: status

    def report_status(self, run: PodRun) -> None:
        pod = self.pod_by_uid(run.uid)
        if pod is None:
            return
        containers = [run.containers[c["name"]].status() for c in pod["spec"]["containers"]]
        ready = run.alive and all(c["ready"] for c in containers)
        status = {
            "phase": run.phase,
            "hostIP": run.host_ip,
            "hostIPs": [{"ip": run.host_ip}],
            "podIP": run.ip,
            "podIPs": [{"ip": run.ip}],
            "startTime": run.start_time,
            "conditions": pod_conditions(pod, run, ready),
            "containerStatuses": containers,
        }
        try:
            updated = self.api.patch(f"{pod_path(pod)}/status", {"status": status})
            self.pods[(run.namespace, run.name)] = updated
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    def report_waiting(self, pod: JsonObject, waiting: NotReadyToStart) -> None:
        statuses = [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": waiting.reason, "message": waiting.message}},
                "lastState": {},
            }
            for c in pod["spec"]["containers"]
        ]
        status = {
            "phase": "Pending",
            "hostIP": self.node_ips[pod["spec"]["nodeName"]],
            "conditions": pod_conditions(pod, None, False),
            "containerStatuses": statuses,
        }
        try:
            self.api.patch(f"{pod_path(pod)}/status", {"status": status})
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    # ------------------------------------------------------------ DNS stand-in

    def render_hosts_for(self, run: PodRun) -> str:
        running = []
        for other in self.runs.values():
            if not other.alive or other.kill_deadline is not None or other.vanished:
                continue
            pod = self.pod_by_uid(other.uid)
            labels = (pod or {}).get("metadata", {}).get("labels", {}) or {}
            running.append(
                RunningPod(
                    namespace=other.namespace,
                    name=other.name,
                    ip=other.ip,
                    hostname=other.hostname if other.hostname_is_explicit else None,
                    subdomain=other.subdomain,
                    labels=labels,
                )
            )
        services = [
            ServiceEntry(ns, name, svc.get("spec", {}).get("selector"))
            for (ns, name), svc in self.services.items()
        ]
        return render_hosts(
            namespace=run.namespace,
            pod_ip=run.ip,
            hostname=run.hostname,
            subdomain=run.subdomain,
            pods=running,
            services=services,
        )

    def refresh_hosts(self) -> None:
        """Rewrite changed hosts files in place (same inode: the bind mounts see the change)."""
        for run in self.runs.values():
            if not run.alive:
                continue
            text = self.render_hosts_for(run)
            if text != run.hosts_text:
                with open(run.hosts_file, "r+") as hosts:
                    hosts.write(text)
                    hosts.truncate()
                run.hosts_text = text

    # ------------------------------------------------------------ fault controls

    def find_run(self, namespace: str, name: str) -> PodRun:
        for run in self.runs.values():
            if run.namespace == namespace and run.name == name and not run.vanished:
                return run
        raise KeyError(f"no harness pod {namespace}/{name}")

    def signal_pod(self, run: PodRun, sig: int) -> None:
        """Every process of the pod (cgroup), or each container's process group as fallback."""
        if run.cgroup is not None:
            cgroups.signal_all(run.cgroup, sig)
        for container in run.containers.values():
            if container.running:
                os_killpg(container.popen.pid, sig)

    def freeze_pod(self, namespace: str, name: str, frozen: bool) -> JsonObject:
        run = self.find_run(namespace, name)
        if run.cgroup is not None:
            cgroups.freeze(run.cgroup, frozen)
            deadline = time.monotonic() + 5
            while cgroups.is_frozen(run.cgroup) != frozen and time.monotonic() < deadline:
                time.sleep(0.02)
        else:
            self.signal_pod(run, signal.SIGSTOP if frozen else signal.SIGCONT)
        return {"pod": f"{namespace}/{name}", "frozen": frozen}

    def kill_pod(self, namespace: str, name: str, sig: int) -> JsonObject:
        run = self.find_run(namespace, name)
        self.signal_pod(run, sig)
        return {"pod": f"{namespace}/{name}", "signal": sig}

    def describe_pods(self) -> list[JsonObject]:
        return [
            {
                "namespace": run.namespace,
                "name": run.name,
                "uid": run.uid,
                "node": run.node,
                "ip": run.ip,
                "phase": run.phase,
                "pgids": run.pgids(),
                "cgroup": str(run.cgroup) if run.cgroup else None,
            }
            for run in self.runs.values()
        ]

    # ------------------------------------------------------------ teardown

    def cleanup(self, run: PodRun) -> None:
        """Release what a pod held once all its processes are gone (IP, dirs, mount points)."""
        if run.cleaned:
            return
        run.cleaned = True
        self.ips.release(run.ip)
        self.release_host_mountpoints(run.host_mountpoints)
        if run.cgroup is not None:
            cgroups.remove(run.cgroup, timeout=2)
        shutil.rmtree(run.pod_dir, ignore_errors=True)

    def shutdown(self) -> None:
        log("shutting down: killing every pod process")
        for run in self.runs.values():
            if run.alive:
                self.signal_pod(run, signal.SIGKILL)
        deadline = time.monotonic() + 10
        for run in self.runs.values():
            for container in run.containers.values():
                try:
                    container.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            self.cleanup(run)
        if self.cgroups is not None:
            cgroups.signal_all(self.cgroups.base, signal.SIGKILL)
            cgroups.remove(self.cgroups.base, timeout=5)
        log("stopped")


def mounted_in_any_namespace(path: Path) -> bool:
    """Whether `path` (or something below it) is a mount point in any process's mount namespace.

    Two harness clusters may create the same host mount point (e.g. /checkpoints); the one that
    finishes first must not remove it while pods of the other still mount something there.
    """
    target, seen = str(path), set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            namespace = os.readlink(proc / "ns" / "mnt")
            if namespace in seen:
                continue
            seen.add(namespace)
            mountinfo = (proc / "mountinfo").read_text()
        except OSError:
            continue
        for line in mountinfo.splitlines():
            mount_point = line.split(" ", 5)[4].replace("\\040", " ")
            if mount_point == target or mount_point.startswith(target + "/"):
                return True
    return False


def pod_path(pod: JsonObject) -> str:
    meta = pod["metadata"]
    return f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"


def os_killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.nodes", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--shared-dir", type=Path, required=True)
    parser.add_argument("--state-file", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--prefix", default="p5-node")
    args = parser.parse_args(argv)
    kubelet = Kubelet(
        KubeApi.from_kubeconfig(args.kubeconfig),
        args.run_dir.resolve(),
        args.shared_dir.resolve(),
        args.nodes,
        args.prefix,
    )

    def stop(signum: int, _frame: object) -> None:
        kubelet.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, stop)
    kubelet.run(args.state_file)


if __name__ == "__main__":
    main()
