"""A real, local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager, scheduler.

Everything listens on 127.0.0.1 only, on free ports, with a throw-away CA (ECDSA P-256, made with
openssl) and an admin client certificate in `system:masters`. Flags follow controller-runtime's
envtest (docs/control-plane.md in the shared docs, section 4). Each binary runs in its own process
group (see `procs`), logging to `<run_dir>/logs/<name>.log`.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from harness.procs import ManagedProcess, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-testbin.sh"
READY_TIMEOUT = 90.0

# Controllers the tests rely on (names as kube-controller-manager 1.34 accepts them).
CONTROLLERS = [
    "garbage-collector-controller",
    "namespace-controller",
    "persistentvolume-binder-controller",
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
    "clusterrole-aggregation-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "ttl-after-finished-controller",
    # No endpoints/endpointslice controllers: the API server refuses loopback addresses in
    # Endpoints, and every pod here has a 127.x address (the harness resolves Service names
    # itself, see kubelet/hostsfile.py). With them on, every Service change logs a failed update
    # Event.
    "serviceaccount-controller",
    "pod-garbage-collector-controller",
    "job-controller",
    "replicaset-controller",
    "deployment-controller",
    "statefulset-controller",
    "disruption-controller",
    "root-ca-certificate-publisher-controller",
]

# The node-lifecycle controller marks a node Ready=Unknown (and taints it unreachable) when it has
# seen no Lease renewal or status for this long; 1.34's default is 50 s against kubelet's renewal
# every 10 s. The harness kubelet renews every 2 s (harness.kubelet.nodes), so 15 s still allows
# 7 missed renewals on a busy machine while a partition shows within 15-17 s.
NODE_MONITOR_GRACE_SECONDS = 15
NODE_MONITOR_PERIOD_SECONDS = 2  # how often the controller looks (default 5 s)


def free_ports(count: int) -> list[int]:
    """Distinct ports that are free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def ensure_binaries() -> Path:
    """The directory with etcd, kube-*, kubectl and helm; builds them (slowly) when missing."""
    process = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=None, text=True
    )
    out, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed with exit code {process.returncode}")
    return Path(out.strip().splitlines()[-1])


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _key(pki: Path, name: str) -> None:
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", name, cwd=pki)


def sign_certificate(pki: Path, name: str, subject: str, extensions: str) -> None:
    """`<pki>/<name>.key` and `<name>.crt`, signed by the cluster's CA (`make_pki`), 7 days."""
    _key(pki, f"{name}.key")
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=pki)
    (pki / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "7", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        cwd=pki,
    )  # fmt: skip


def make_pki(pki: Path) -> None:
    """CA, API server serving cert, admin client cert, service-account signing key (7 days)."""
    pki.mkdir(parents=True, exist_ok=True)

    def key(name: str) -> None:
        _key(pki, name)

    def sign(name: str, subject: str, extensions: str) -> None:
        sign_certificate(pki, name, subject, extensions)

    key("ca.key")
    _openssl(
        "req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=harness-ca", "-days", "7",
        "-out", "ca.crt", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    sign(
        "apiserver",
        "/CN=kube-apiserver",
        "subjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.0.0.1\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    sign(
        "admin",
        "/O=system:masters/CN=admin",
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n",
    )
    key("sa.key")
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, pki: Path) -> None:
    """Admin kubeconfig (JSON is valid YAML; kubectl, helm and the Python client all read it)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "harness",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate": str(pki / "admin.crt"),
                    "client-key": str(pki / "admin.key"),
                },
            }
        ],
        "contexts": [{"name": "harness", "context": {"cluster": "harness", "user": "admin"}}],
        "current-context": "harness",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")


def _https_ok(url: str, ca_file: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca_file))
    with urllib.request.urlopen(url, context=context, timeout=5) as response:
        return bool(response.status == 200)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bool(response.status == 200)


def _insecure_https_ok(url: str) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, context=context, timeout=5) as response:
        return bool(response.status == 200)


class ControlPlane:
    """Starts and stops the four control-plane processes of one cluster."""

    def __init__(self, bin_dir: Path, run_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.run_dir = run_dir
        self.pki = run_dir / "pki"
        self.logs = run_dir / "logs"
        self.kubeconfig = run_dir / "admin.kubeconfig"
        self.etcd_port, self.peer_port, self.api_port, self.scheduler_port = free_ports(4)
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.processes: list[ManagedProcess] = []
        self.timings: dict[str, float] = {}
        self._argv: dict[str, list[str]] = {}
        self._ready: dict[str, Callable[[], bool]] = {}

    def _start(self, name: str, args: list[str]) -> ManagedProcess:
        argv = [str(self.bin_dir / name), *args]
        process = ManagedProcess(name, argv, self.logs / f"{name}.log")
        self._argv[name] = argv
        self.processes.append(process)
        return process

    def process_named(self, name: str) -> ManagedProcess:
        """The running (or stopped) process of server `name` (`etcd`, `kube-apiserver`, ...)."""
        for process in self.processes:
            if process.name == name:
                return process
        raise KeyError(f"no control-plane server named {name!r}")

    def is_ready(self, name: str) -> bool:
        """Whether server `name` answers its readiness check (etcd /health, kube-apiserver
        /readyz; the others: alive) right now."""
        try:
            return bool(self._ready.get(name, self.process_named(name).alive)())
        except Exception:
            return False

    def stop_server(self, name: str) -> None:
        """Stop one server (SIGTERM, SIGKILL after 10 s), as an outage; `start_server` brings it
        back. The other servers keep running and reconnect on their own."""
        self.process_named(name).stop(timeout=10)

    def start_server(self, name: str, timeout: float = READY_TIMEOUT) -> ManagedProcess:
        """Start a server stopped by `stop_server` again with the same command line: the same
        port, data directory (etcd keeps its data) and certificates; its log goes on in the same
        file. Waits until it is ready (etcd /health, kube-apiserver /readyz; the others: alive).
        """
        old = self.process_named(name)
        if old.alive():
            raise RuntimeError(f"{name} is still running")
        process = ManagedProcess(name, self._argv[name], self.logs / f"{name}.log")
        self.processes[self.processes.index(old)] = process  # keep the stop order
        wait_until(lambda: self.is_ready(name), timeout, f"{name} ready again",
                   processes=[process])
        return process

    def start_storage_and_api(self) -> None:
        """etcd + kube-apiserver, ready to serve (CRDs can be applied after this)."""
        t0 = time.monotonic()
        make_pki(self.pki)
        write_kubeconfig(self.kubeconfig, self.server, self.pki)
        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        etcd = self._start(
            "etcd",
            [
                "--name=harness", f"--data-dir={self.run_dir / 'etcd-data'}",
                f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=harness={peer_url}", "--unsafe-no-fsync",
                "--log-level=warn", "--quota-backend-bytes=2147483648",
            ],
        )  # fmt: skip
        self._ready["etcd"] = lambda: _http_ok(f"{etcd_url}/health")
        wait_until(self._ready["etcd"], READY_TIMEOUT, "etcd health", processes=[etcd])
        self.timings["etcd"] = time.monotonic() - t0
        pki = self.pki
        apiserver = self._start(
            "kube-apiserver",
            [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}", f"--cert-dir={pki}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--service-account-issuer=https://127.0.0.1:{self.api_port}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--authorization-mode=RBAC", "--allow-privileged=true",
                "--disable-admission-plugins=ServiceAccount",
                "--enable-priority-and-fairness=false",
                "--profiling=false", "--v=1",
            ],
        )  # fmt: skip
        self._ready["kube-apiserver"] = lambda: _https_ok(f"{self.server}/readyz", pki / "ca.crt")
        wait_until(
            self._ready["kube-apiserver"],
            READY_TIMEOUT, "kube-apiserver /readyz", processes=[etcd, apiserver],
        )  # fmt: skip
        self.timings["kube-apiserver"] = time.monotonic() - t0

    def start_controllers(self) -> None:
        """kube-controller-manager + kube-scheduler (after CRDs are in, so the GC knows them)."""
        t0 = time.monotonic()
        kubeconfig = str(self.kubeconfig)
        kcm = self._start(
            "kube-controller-manager",
            [
                f"--kubeconfig={kubeconfig}", "--secure-port=0", "--leader-elect=false",
                f"--root-ca-file={self.pki / 'ca.crt'}",
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                "--use-service-account-credentials=false",
                f"--controllers={','.join(CONTROLLERS)}",
                "--kube-api-qps=100", "--kube-api-burst=200",
                "--concurrent-gc-syncs=5", "--profiling=false", "--v=1",
                f"--node-monitor-grace-period={NODE_MONITOR_GRACE_SECONDS}s",
                f"--node-monitor-period={NODE_MONITOR_PERIOD_SECONDS}s",
            ],
        )  # fmt: skip
        scheduler = self._start(
            "kube-scheduler",
            [
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1", f"--secure-port={self.scheduler_port}",
                "--leader-elect=false", "--profiling=false", "--v=1",
            ],
        )  # fmt: skip
        wait_until(
            lambda: _insecure_https_ok(f"https://127.0.0.1:{self.scheduler_port}/healthz"),
            READY_TIMEOUT, "kube-scheduler /healthz", processes=[kcm, scheduler],
        )  # fmt: skip
        self.timings["kube-scheduler"] = time.monotonic() - t0

    def stop(self) -> None:
        """Stop in reverse start order; never raises."""
        for process in reversed(self.processes):
            try:
                process.stop(timeout=10)
            except Exception:
                pass
        self.processes.clear()
