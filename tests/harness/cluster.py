"""`Cluster`: one local Kubernetes cluster for tests (control plane + process-backed p5 nodes).

Start order matters: etcd and kube-apiserver first, then every `crds/*.yaml` of the repository is
applied, then kube-controller-manager (so its garbage collector knows the CRD kinds from the
start) and kube-scheduler, then the node harness in its own process (pytest's GIL must not slow
it). `stop()` tears everything down in reverse and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.control import NodeControl
from harness.controlplane import REPO_ROOT, ControlPlane, ensure_binaries
from harness.kubeapi import ApiError, KubeApi
from harness.procs import ManagedProcess, wait_until

if TYPE_CHECKING:
    import kubernetes.client

TESTS_DIR = Path(__file__).resolve().parents[1]
# The venv running the harness: its pods run `python` and NVRx's commands (`nvrx-control`) from
# it. From a `git worktree` without a .venv of its own (a benchmark at an older commit), the
# worktree's `.venv/bin` does not exist and the pods would run the system's Python.
VENV_BIN = (Path(sys.prefix) / "bin" if sys.prefix != sys.base_prefix
            else REPO_ROOT / ".venv" / "bin")
CRD_DIR = REPO_ROOT / "crds"
NODE_READY_TIMEOUT = 90.0
START_ATTEMPTS = 3


class CommandError(subprocess.CalledProcessError):
    """A kubectl/helm call failed; the message carries its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


def python_module_argv(module: str) -> list[str]:
    """argv running `module`'s main() with tests/ importable, without setting PYTHONPATH.

    The node harness hands its own environment to every pod; a PYTHONPATH pointing at tests/
    must not leak into the trainer's processes.
    """
    code = f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); import {module} as m; m.main()"
    return [sys.executable, "-c", code]


def without_tests_on_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """`env` minus tests/ on PYTHONPATH (pods inherit the node harness's environment)."""
    paths = env.pop("PYTHONPATH", "").split(os.pathsep)
    kept = [p for p in paths if p and Path(p).resolve() != TESTS_DIR]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


def node_is_ready(node: dict[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions", []) or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


class Cluster:
    """A running cluster; build one with `Cluster.start(run_dir)`."""

    def __init__(self, run_dir: Path, bin_dir: Path, control_plane: ControlPlane) -> None:
        self.run_dir = run_dir
        self.bin_dir = bin_dir
        self.control_plane = control_plane
        self.kubeconfig = control_plane.kubeconfig
        self.shared_dir = run_dir / "shared"
        self._api: KubeApi | None = None
        self.node_harness: ManagedProcess | None = None
        self.nodes: NodeControl = NodeControl("http://127.0.0.1:0")
        self.node_harness_state: dict[str, Any] = {}
        self.timings: dict[str, float] = {}
        self._api_client: Any = None

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, run_dir: Path, nodes: int = 3, crd_dir: Path | None = CRD_DIR) -> Cluster:
        """Start everything and wait until the nodes are Ready; tears down again on failure."""
        run_dir = run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        bin_dir = ensure_binaries()
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return cls._start_once(run_dir, bin_dir, nodes, crd_dir)
            except RuntimeError as error:  # a server exited during start-up
                # Free ports are picked before the servers bind them; on a busy machine another
                # process can take one in between. Start again on fresh ports.
                if attempt == START_ATTEMPTS:
                    raise
                print(f"[harness] start attempt {attempt} failed, retrying: {error}", flush=True)
                for stale in ("etcd-data", "pki"):
                    shutil.rmtree(run_dir / stale, ignore_errors=True)
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, run_dir: Path, bin_dir: Path, nodes: int, crd_dir: Path | None) -> Cluster:
        t0 = time.monotonic()
        control_plane = ControlPlane(bin_dir, run_dir)
        cluster = cls(run_dir, bin_dir, control_plane)
        try:
            control_plane.start_storage_and_api()
            cluster.timings["apiserver_ready"] = time.monotonic() - t0
            cluster.apply_crds(crd_dir)
            control_plane.start_controllers()
            cluster.timings["controllers_ready"] = time.monotonic() - t0
            cluster.start_node_harness(nodes)
            cluster.timings["nodes_ready"] = time.monotonic() - t0
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def apply_crds(self, crd_dir: Path | None) -> None:
        files = sorted(crd_dir.glob("*.yaml")) if crd_dir and crd_dir.is_dir() else []
        if not files:
            return
        for file in files:
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(file))
        # Right after an apply a CRD can still have no status.conditions at all, and
        # `kubectl wait` then fails at once ("status.conditions accessor error") instead of
        # waiting: ask again until it really waits and succeeds.
        deadline = time.monotonic() + 60
        while True:
            result = self.kubectl("wait", "--for=condition=Established", "crd", "--all",
                                  "--timeout=60s", check=False)
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"CRDs not Established: {result.stderr.strip()}")
            time.sleep(0.5)

    def start_node_harness(self, nodes: int) -> None:
        state_file = self.run_dir / "nodes.json"
        state_file.unlink(missing_ok=True)
        self.node_harness = ManagedProcess(
            "nodes",
            [
                *python_module_argv("harness.kubelet"),
                f"--kubeconfig={self.kubeconfig}", f"--run-dir={self.run_dir}",
                f"--shared-dir={self.shared_dir}", f"--state-file={state_file}",
                f"--nodes={nodes}",
            ],
            self.run_dir / "logs" / "nodes.log",
            env=without_tests_on_pythonpath(self.env()),
            death_signal=signal.SIGTERM,
        )  # fmt: skip
        wait_until(state_file.exists, 30, "node harness start", processes=[self.node_harness])
        self.node_harness_state = json.loads(state_file.read_text())
        self.nodes = NodeControl(self.node_harness_state["control_url"])
        names = set(self.node_harness_state["nodes"])

        def all_ready() -> bool:
            listed = self.api.get("/api/v1/nodes")["items"]
            ready = {n["metadata"]["name"] for n in listed if node_is_ready(n)}
            untainted = {
                n["metadata"]["name"] for n in listed if not (n.get("spec", {}).get("taints"))
            }
            return names <= ready and names <= untainted

        wait_until(
            all_ready,
            NODE_READY_TIMEOUT,
            "nodes Ready and untainted",
            interval=0.5,
            processes=[self.node_harness, *self.control_plane.processes],
        )

    def stop(self) -> None:
        """Stop the node harness (it kills every pod process), then the control plane."""
        if self.node_harness is not None:
            self.node_harness.stop(timeout=20)
            self.node_harness = None
        self.control_plane.stop()
        if self._api_client is not None:
            try:
                self._api_client.close()
            except Exception:
                pass
            self._api_client = None

    def pids(self) -> dict[str, int]:
        """Process (group) id of every server this cluster runs."""
        found = {p.name: p.pid for p in self.control_plane.processes}
        if self.node_harness is not None:
            found["nodes"] = self.node_harness.pid
        return found

    # ------------------------------------------------------------ tools

    @property
    def api(self) -> KubeApi:
        """A small dict-based REST client (see `harness.kubeapi`), handy in tests."""
        if self._api is None:
            self._api = KubeApi.from_kubeconfig(self.kubeconfig)
        return self._api

    def env(self) -> dict[str, str]:
        """os.environ + KUBECONFIG, with the binaries and the project venv first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = os.pathsep.join([str(self.bin_dir), str(VENV_BIN), env.get("PATH", "")])
        return env

    def _run(
        self, tool: str, args: tuple[str, ...], check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.bin_dir / tool), *args]
        result = subprocess.run(
            argv, env=self.env(), input=input, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise CommandError(result.returncode, argv, result.stdout, result.stderr)
        return result

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self._run("kubectl", args, check, input, timeout)

    def helm(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run("helm", args, check, input, timeout)

    def api_client(self) -> kubernetes.client.ApiClient:
        if self._api_client is None:
            import kubernetes.config

            self._api_client = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
                config_file=str(self.kubeconfig)
            )
        client: kubernetes.client.ApiClient = self._api_client
        return client

    def core_v1(self) -> kubernetes.client.CoreV1Api:
        import kubernetes.client

        return kubernetes.client.CoreV1Api(self.api_client())

    def custom_objects(self) -> kubernetes.client.CustomObjectsApi:
        import kubernetes.client

        return kubernetes.client.CustomObjectsApi(self.api_client())

    # ------------------------------------------------------------ test helpers

    def create_namespace(self, prefix: str = "test") -> str:
        """A fresh namespace `<prefix>-<random>`."""
        name = f"{prefix}-{secrets.token_hex(3)}"
        self.api.create("/api/v1/namespaces", {"metadata": {"name": name}})
        return name

    def delete_namespace(self, name: str) -> None:
        """Start deleting a namespace; does not wait (the namespace controller finishes it)."""
        try:
            self.api.delete(f"/api/v1/namespaces/{name}")
        except ApiError:
            pass

    def pod_log_path(self, namespace: str, pod: str, container: str | None = None) -> Path:
        logs = self.run_dir / "pods"
        if container is not None:
            return logs / f"{namespace}_{pod}_{container}.log"
        matches = sorted(logs.glob(f"{namespace}_{pod}_*.log"))
        if len(matches) > 1:
            raise ValueError(f"pod {namespace}/{pod} has several containers; name one")
        return matches[0] if matches else logs / f"{namespace}_{pod}_.log"

    def pod_log(self, namespace: str, pod: str, container: str | None = None) -> str:
        """stdout+stderr of a pod's container so far ('' before it started).

        `kubectl logs` does not work on harness nodes (there is no kubelet API).
        """
        path = self.pod_log_path(namespace, pod, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_pod(
        self,
        namespace: str,
        name: str,
        phases: tuple[str, ...] = ("Running",),
        timeout: float = 60,
    ) -> dict[str, Any]:
        """Poll until the pod reaches one of `phases`; returns the pod (dict)."""
        deadline = time.monotonic() + timeout
        pod: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            try:
                pod = self.api.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
            except ApiError as error:
                if error.status != 404:
                    raise
                pod = None
            if pod is not None and pod.get("status", {}).get("phase") in phases:
                return pod
            time.sleep(0.2)
        status = (pod or {}).get("status")
        raise TimeoutError(f"pod {namespace}/{name} not in {phases} after {timeout} s: {status}")

    def cordon_node(self, name: str) -> None:
        """`kubectl cordon`: spec.unschedulable=true; the scheduler places no new pod there."""
        self.api.patch(f"/api/v1/nodes/{name}", {"spec": {"unschedulable": True}})

    def uncordon_node(self, name: str) -> None:
        self.api.patch(f"/api/v1/nodes/{name}", {"spec": {"unschedulable": None}})

    def wait_for_pod_gone(self, namespace: str, name: str, timeout: float = 60) -> None:
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        wait_until(lambda: self.api.get_or_none(path) is None, timeout, f"pod {name} to be gone")
