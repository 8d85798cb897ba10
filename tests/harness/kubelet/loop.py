"""The kubelet's owner and main loop: informers and process-exit waiters only enqueue events; one
reconcile thread handles them in order (pod, service and PVC events, process exits, control API
calls) and makes every decision and API write. Also the pod lifecycle driven by those events
(start, deletion with grace, exits, restarts) and the entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from harness import cgroups
from harness.controlapi import start_control_server
from harness.kubeapi import JsonObject, KubeApi
from harness.kubelet.runtime import RuntimeMixin
from harness.kubelet.state import log, os_kill, pod_path
from harness.nodestate import (
    ContainerRun,
    PodRun,
    exit_code_of,
    now_rfc3339,
    restart_delay,
)

MAX_GRACE_SECONDS = 30.0


class Kubelet(RuntimeMixin):
    """The one owner of all node and pod state; only its reconcile thread touches it."""

    def run(self, state_file: Path) -> None:
        for directory in (self.logs_dir, self.data_dir, self.shared_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self.register_nodes()
        self.start_heartbeats()
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
            if not self.cut_off(run.node):  # a partitioned node's pods are frozen as a whole
                self.restart_due_containers(run)
            if run.kill_deadline is not None and now >= run.kill_deadline and run.alive:
                log(f"{run.namespace}/{run.name}: grace period over, SIGKILL")
                self.signal_pod(run, signal.SIGKILL)
                run.kill_deadline = None
        self.report_unwritten()
        for uid in list(self.waiting):
            pod = self.pod_by_uid(uid)
            if pod is None:
                self.waiting.pop(uid, None)
            else:
                self.reconcile(pod)

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
        if spec.get("nodeName") not in self.node_ready or self.cut_off(spec["nodeName"]):
            return  # not ours, or partitioned: `heal_node` reconciles it again
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
                    # Like a container runtime: SIGTERM to the container's main process only
                    # (its PID 1), never to its children (ft_launcher's rank monitors, a
                    # worker's writer), which the main process stops itself; SIGKILL to all.
                    for container in run.containers.values():
                        if container.running:
                            os_kill(container.popen.pid, signal.SIGTERM)
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
        if uid in self.delete_requested or self.cut_off(pod["spec"].get("nodeName")):
            return
        self.delete_requested.add(uid)
        self.api.delete(pod_path(pod), {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})

    def pod_vanished(self, uid: str) -> None:
        self.waiting.pop(uid, None)
        self.image_pulls.pop(uid, None)
        self.delete_requested.discard(uid)
        self.done.discard(uid)
        run = self.runs.get(uid)
        if run is None:
            return
        if self.cut_off(run.node):  # the kubelet cannot know yet; `heal_node` kills them
            log(f"{run.namespace}/{run.name} is gone from the API; its node is partitioned")
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
        container.read_termination_message()
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

    def partition_node(self, name: str) -> JsonObject:
        """Cut the node off the API, as a network partition does.

        From now on it renews no Lease and posts no node or pod status, and does not act on its
        pods' API objects: deletions are not carried out (the pods stay Terminating), pods bound
        to it are not started, and a pod that vanishes from the API (force-deleted) keeps its
        processes. Those processes, like every process of the node's pods, are frozen (cgroup
        freezer, SIGSTOP without cgroups): the harness cannot keep a cut-off pod running yet
        unable to reach anything, so it stops it. `heal_node` undoes all of it.
        """
        self.require_node(name)
        with self.heartbeat_lock:  # no renewal of this node starts after this point
            self.partitioned.add(name)
        frozen = []
        for run in self.runs.values():
            if run.node == name and run.alive and not run.vanished:
                self.freeze_run(run, True)
                frozen.append(f"{run.namespace}/{run.name}")
        log(f"{name} partitioned; frozen {frozen}")
        return {"node": name, "partitioned": True, "frozen": frozen}

    def heal_node(self, name: str) -> JsonObject:
        """Reconnect the node and let it catch up, as a kubelet does after a partition.

        The processes of pods force-deleted meanwhile are SIGKILLed while still frozen (they
        never run again); every other pod of the node is thawed. Then the node renews its Lease
        and posts Ready, reports the status of its pods, and reconciles every pod bound to it:
        pods deleted meanwhile are terminated (SIGTERM, grace) and removed, pods bound to it
        meanwhile start.
        """
        self.require_node(name)
        if name not in self.partitioned:
            return {"node": name, "partitioned": False, "killed": []}
        runs = [r for r in self.runs.values() if r.node == name and not r.vanished]
        live = {pod["metadata"]["uid"] for pod in self.pods.values()}
        gone = [run for run in runs if run.uid not in live]
        for run in gone:
            if run.alive:
                self.signal_pod(run, signal.SIGKILL)  # pending before the thaw: no code runs
        for run in runs:
            if run.alive:
                self.freeze_run(run, False)
        with self.heartbeat_lock:
            self.partitioned.discard(name)
            self.node_transition[name] = now_rfc3339()
            if self.node_ready[name]:
                self.renew_lease(name)
                self.post_node_status(name)
        for run in gone:
            self.pod_vanished(run.uid)
        for run in runs:
            if run not in gone:
                self.report_status(run)
        for pod in list(self.pods.values()):
            if pod.get("spec", {}).get("nodeName") == name:
                self.reconcile(pod)
        self.refresh_hosts()
        killed = [f"{run.namespace}/{run.name}" for run in gone]
        log(f"{name} healed; killed the processes of force-deleted pods {killed}")
        return {"node": name, "partitioned": False, "killed": killed}

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.kubelet", description=__doc__)
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
