"""Pods as host process trees: start a pod (IP, env, volumes, one process tree per container under
`podinit` in its own cgroup), restart containers with kubelet's back-off, release what a pod held.

The image is ignored; init containers, probes and image entrypoints are not supported (a container
without `command` leaves its pod Pending with CreateContainerError).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from harness import cgroups
from harness.envvars import EnvResolutionError, expand_command, resolve_container_env
from harness.kubeapi import ApiError, JsonObject
from harness.kubelet import serviceaccount
from harness.kubelet.podstatus import PodStatusMixin
from harness.kubelet.state import log
from harness.nodestate import (
    ContainerRun,
    NotReadyToStart,
    PodRun,
    now_rfc3339,
)

PODINIT = Path(__file__).resolve().parents[1] / "podinit.py"
REPO_ROOT = Path(__file__).resolve().parents[3]


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


class RuntimeMixin(PodStatusMixin):
    """Starts pods as process trees, restarts containers, releases what pods held."""

    def start_pod(self, pod: JsonObject) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid = meta["uid"]
        refused = self.refusal_of(pod)
        if refused is not None:  # retried every tick, like kubelet retries a failed pod sync
            self.note_waiting(pod, refused)
            return
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
            token_dir = self.service_account_token(pod, pod_dir)
            hostname = (spec.get("hostname") or meta["name"])[:63]
            plans = [
                self.container_plan(pod, container, volumes, pod_dir, ip, self.node_ips[node],
                                    token_dir=token_dir)
                for container in spec["containers"]
            ]
        except NotReadyToStart as waiting:
            self.ips.release(ip)
            self.note_waiting(pod, waiting)
            return
        except Exception:
            self.ips.release(ip)
            raise
        self.waiting.pop(uid, None)
        self.image_pulls.pop(uid, None)
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
        self.annotate(run)  # before the status: a pod seen Running already has its annotations
        self.report_status(run)
        self.refresh_hosts()

    def note_waiting(self, pod: JsonObject, waiting: NotReadyToStart) -> None:
        """Keep the pod for a retry next tick; report its Waiting state when that changed."""
        meta, key = pod["metadata"], f"{waiting.reason}: {waiting.message}"
        if self.waiting.get(meta["uid"]) != key:
            self.waiting[meta["uid"]] = key
            log(f"{meta['namespace']}/{meta['name']}: waiting: {key}")
            self.report_waiting(pod, waiting)

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

    def service_account_token(self, pod: JsonObject, pod_dir: Path) -> Path | None:
        """The pod's projected ServiceAccount token directory, or None when it opts out."""
        target = pod_dir / "serviceaccount"
        try:
            projected = serviceaccount.project_token(self.api, pod, target)
        except ApiError as error:  # kubelet retries the pod sync until the token can be had
            raise NotReadyToStart("ContainerCreating",
                                  f"cannot get a service account token: {error}") from error
        return target if projected else None

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
        *,
        token_dir: Path | None = None,
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
        # The node's environment (so .venv/bin is on PATH), less its admin kubeconfig: a pod
        # reaches the API server as its ServiceAccount, through the variables a kubelet sets.
        node_env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        env = {
            **node_env, "HOSTNAME": hostname,
            **serviceaccount.api_service_env(self.api.credentials.server), **container_env,
        }
        mounts: dict[str, tuple[str, bool]] = {
            "/dev/shm": (str(pod_dir / "shm"), False),
            "/etc/hosts": (str(pod_dir / "hosts"), False),
        }
        mounts["/tmp"] = (str(pod_dir / "tmp"), False)
        for keep in paths_to_keep_visible(pod_dir / "work", env.get("PATH", "")):
            mounts[str(keep)] = (str(keep), False)
        # Like the kubelet: a file per container, mounted at terminationMessagePath (the API
        # server defaults it to /dev/termination-log); read when the container exits.
        termination_file = pod_dir / f"termination-{container['name']}"
        termination_file.write_bytes(b"")
        termination_file.chmod(0o666)
        termination_path = container.get("terminationMessagePath") or "/dev/termination-log"
        mounts[termination_path] = (str(termination_file), False)
        for mount in container.get("volumeMounts", []) or []:
            if mount["name"] not in volumes:
                raise NotReadyToStart("CreateContainerConfigError", f"no volume {mount['name']}")
            source = volumes[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = (str(source), bool(mount.get("readOnly", False)))
        if token_dir is not None and serviceaccount.MOUNT_PATH not in mounts:
            mounts[serviceaccount.mount_target()] = (str(token_dir), True)
        return {
            "argv": expand_command(container.get("command"), container.get("args"), container_env),
            "env": env,
            "hostname": hostname,
            "pod_dir": str(pod_dir / "work"),
            "working_dir": container.get("workingDir") or None,
            "mounts": [[source, target, ro] for target, (source, ro) in mounts.items()],
            "mounts_plan": [{"target": target} for target in mounts],
            "termination_file": str(termination_file),
            "termination_policy": container.get("terminationMessagePolicy") or "File",
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
            termination_file=Path(plan["termination_file"]),
            termination_policy=plan["termination_policy"],
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
            container.termination_message = None
            if container.termination_file is not None:  # a new container: a new, empty file
                container.termination_file.write_bytes(b"")
            container.started_at = now_rfc3339()
            container.popen = self.launch(
                run, container.name, container.spec_file, container.log_file
            )
            log(
                f"{run.namespace}/{run.name}/{container.name} restarted ({container.restart_count})"
            )
            self.annotate(run)
            self.report_status(run)

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
