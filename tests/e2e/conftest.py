"""E2E fixtures: the real operator (`python -m rtj_operator`) against the session's cluster.

Each test gets its own namespace and its own operator process that watches only that namespace,
on free ports (metrics, liveness and the jobs' rendezvous port), so tests and other users of the
machine do not see each other's jobs. The operator is stopped (its process group) afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when pytest dies (a killed run skips teardown)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log_path: Path
    namespace: str
    env: dict[str, str]
    liveness_port: int
    starts: int = 1

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the operator's process group (no shutdown, no last status patch)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def start(self) -> None:
        """Start a new operator process (after `kill`) and wait until it is live; its output is
        appended to the same log."""
        self.process = _spawn(self.env, self.log_path)
        self.starts += 1
        self.wait_live()

    def wait_live(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"the operator exited with {self.process.returncode}:\n{self.log()}")
            try:
                urllib.request.urlopen(
                    f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1).read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the operator did not become live:\n{self.log()}")
                time.sleep(0.3)


def _spawn(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "rtj_operator"], env=env, cwd=ROOT,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent,
        )


@pytest.fixture
def operator(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    liveness = free_port()
    env = cluster.env() | {
        "RTJ_OPERATOR_NAMESPACE": namespace,
        "RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS": "2",
        "RTJ_OPERATOR_METRICS_PORT": str(free_port()),
        "RTJ_OPERATOR_LIVENESS_PORT": str(liveness),
        "RTJ_OPERATOR_RENDEZVOUS_PORT": str(free_port()),
    }
    log_path = tmp_path / "operator.log"
    handle = OperatorProcess(_spawn(env, log_path), log_path, namespace, env, liveness)
    try:
        handle.wait_live()
        yield handle
    finally:
        # Delete the namespace's jobs while the operator runs: it removes their finalizer (and
        # their pods), so the namespace can go away afterwards (a test that killed it and
        # failed before starting it again gets one back here).
        if handle.process.poll() is not None:
            with contextlib.suppress(Exception, pytest.fail.Exception):
                handle.start()
        cluster.kubectl("delete", "resilienttrainingjobs", "--all", "-n", namespace,
                        "--timeout=60s", check=False, timeout=90)
        process = handle.process
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
