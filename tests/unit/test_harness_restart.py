"""The control plane's outage controls (`ControlPlane.stop_server` / `start_server`): a server
comes back with the same command line (port, data directory, certificates), in its place in the
stop order, and is waited for until ready. Processes are stand-ins: no server runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from harness import controlplane
from harness.controlplane import ControlPlane

pytestmark = pytest.mark.unit


class FakeProcess:
    started: list[FakeProcess] = []

    def __init__(self, name: str, argv: Sequence[str], log_file: Path, **_: Any) -> None:
        self.name, self.argv, self.log_file = name, list(argv), log_file
        self.running = True
        FakeProcess.started.append(self)

    def alive(self) -> bool:
        return self.running

    def stop(self, timeout: float = 10.0) -> None:
        self.running = False


def test_a_stopped_server_starts_again_with_its_command_line_in_its_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controlplane, "ManagedProcess", FakeProcess)
    plane = ControlPlane(Path("/bin"), tmp_path)
    etcd = plane._start("etcd", ["--data-dir=/d", "--listen-client-urls=http://127.0.0.1:1"])
    plane._start("kube-apiserver", ["--secure-port=2"])
    checks: list[str] = []

    def etcd_ready() -> bool:
        checks.append("etcd")
        return plane.process_named("etcd").alive()

    plane._ready["etcd"] = etcd_ready
    assert plane.is_ready("etcd") and plane.is_ready("kube-apiserver")
    with pytest.raises(RuntimeError, match="still running"):
        plane.start_server("etcd")
    plane.stop_server("etcd")
    assert not etcd.alive() and not plane.is_ready("etcd")
    again = plane.start_server("etcd")
    assert again is not etcd and again.alive()
    assert FakeProcess.started[-1].argv == ["/bin/etcd", "--data-dir=/d",
                                            "--listen-client-urls=http://127.0.0.1:1"]
    assert [p.name for p in plane.processes] == ["etcd", "kube-apiserver"]
    assert plane.processes[0] is again and checks
    with pytest.raises(KeyError, match="kube-scheduler"):
        plane.stop_server("kube-scheduler")
