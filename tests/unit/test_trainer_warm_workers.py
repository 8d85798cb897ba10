"""Warm workers' pure pieces (rtj_trainer.warm.wire, warmpool, attach): message framing, the
request's checks, the argv rewrite, the startup-environment check, how the client ends, and the
client's hand-over over a real Unix socket to a listener that answers as a warm worker does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rtj_trainer.launcher import warmpool
from rtj_trainer.warm import attach
from rtj_trainer.warm import wire as warmwire

pytestmark = pytest.mark.unit

TRAIN_LOCAL_ARGS = [
    "--standalone", "--nnodes=1", "--nproc-per-node=2", "--ft-initial-rank-heartbeat-timeout=60",
    "--no-python", "/venv/bin/python", "-m", "rtj_trainer", "--preset", "tiny",
    "--set", "train.steps=30",
]


def _request(**overrides: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"args": ["--preset", "tiny"], "env": {"RANK": "0"},
                               "cwd": "/work", "pid": 42}
    message.update(overrides)
    return message


def test_messages_survive_framing_split_at_every_byte() -> None:
    request = warmwire.Request(args=["--set", "train.steps=3"], env={"A": "é"}, cwd="/", pid=7)
    stream = request.encode() + warmwire.encode({"exit": 3})
    decoder = warmwire.Decoder()
    received = []
    for index in range(len(stream)):
        received += decoder.feed(stream[index:index + 1])
    assert [warmwire.Request.from_message(received[0]), received[1]] == [request, {"exit": 3}]
    assert decoder.pending == 0


@pytest.mark.parametrize(("body", "error"), [
    (b"[1, 2]", "not a JSON object"),
    (b"{nope", "not JSON"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_malformed_message_is_a_wire_error(body: bytes, error: str) -> None:
    with pytest.raises(warmwire.WireError, match=error):
        warmwire.Decoder().feed(len(body).to_bytes(4, "big") + body)


def test_an_oversized_length_is_refused_before_its_body_arrives() -> None:
    with pytest.raises(warmwire.WireError, match="exceeds"):
        warmwire.Decoder().feed((warmwire.MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"))


@pytest.mark.parametrize(("field", "value"), [
    ("args", "--preset tiny"), ("args", [1]), ("env", {"A": 1}), ("env", []), ("cwd", ""),
    ("pid", 0), ("pid", True), ("pid", "42"),
])
def test_a_request_with_a_bad_field_names_it(field: str, value: Any) -> None:
    with pytest.raises(warmwire.WireError, match=f"request.{field}"):
        warmwire.Request.from_message(_request(**{field: value}))


def test_the_worker_command_becomes_the_attach_client_and_nothing_else_changes() -> None:
    rewritten = warmwire.attach_argv(TRAIN_LOCAL_ARGS)
    assert rewritten is not None
    args, python = rewritten
    assert python == "/venv/bin/python"
    expected = list(TRAIN_LOCAL_ARGS)
    expected[expected.index("rtj_trainer")] = "rtj_trainer.warm.attach"
    assert args == expected


@pytest.mark.parametrize("args", [
    ["--nnodes=1", "/venv/bin/python", "-m", "rtj_trainer"],  # no --no-python
    ["--no-python", "/venv/bin/python", "-m", "other_trainer", "--x"],
    ["--no-python", "/venv/bin/python", "train.py"],
    ["--no-python"],
])
def test_another_worker_command_gets_no_warm_workers(args: list[str]) -> None:
    assert warmwire.attach_argv(args) is None


def test_startup_variables_must_agree_and_run_time_ones_need_not() -> None:
    warm = {"PYTHONPATH": "/a", "PYTHONUNBUFFERED": "1", "PATH": "/bin",
            "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}
    worker = {**warm, "RANK": "1", "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "r",
              "TORCHINDUCTOR_CACHE_DIR": "/tmp/y", "PATH": "/usr/bin"}
    assert warmwire.startup_env_mismatch(worker, warm) is None
    assert warmwire.startup_env_mismatch({**worker, "PYTHONPATH": "/b"}, warm) == "PYTHONPATH"
    assert warmwire.startup_env_mismatch({**worker, "TORCH_LOGS": "+dynamo"}, warm) == "TORCH_LOGS"
    without = {k: v for k, v in worker.items() if k != "PYTHONUNBUFFERED"}
    assert warmwire.startup_env_mismatch(without, warm) == "PYTHONUNBUFFERED"


@pytest.mark.parametrize(("message", "forwarded", "expected"), [
    ({"exit": 0}, None, warmwire.Ending(code=0)),
    ({"exit": 94}, signal.SIGTERM, warmwire.Ending(code=94)),  # its own word wins
    ({"exit": -1}, None, warmwire.Ending(code=255)),  # as the kernel truncates it
    ({"exit": True}, None, warmwire.Ending(signal=signal.SIGKILL)),
    (None, None, warmwire.Ending(signal=signal.SIGKILL)),  # killed from outside
    (None, signal.SIGTERM, warmwire.Ending(signal=signal.SIGTERM)),  # a restart's SIGTERM
    (None, signal.SIGUSR2, warmwire.Ending(signal=signal.SIGUSR2)),  # stop outside the loop
])
def test_the_client_ends_as_the_warm_worker_did(message: dict[str, Any] | None,
                                                forwarded: int | None,
                                                expected: warmwire.Ending) -> None:
    assert warmwire.ending(message, forwarded) == expected


def test_local_ranks_start_their_search_at_different_warm_workers(tmp_path: Path) -> None:
    for name in ("warm-30.sock", "warm-100.sock", "warm-7.sock", ".starting-5.sock", "x.sock"):
        (tmp_path / name).touch()
    names = [[Path(p).name for p in warmwire.warm_sockets(str(tmp_path), rank)]
             for rank in range(4)]
    assert names[0] == ["warm-7.sock", "warm-30.sock", "warm-100.sock"]
    assert names[1] == ["warm-30.sock", "warm-100.sock", "warm-7.sock"]
    assert names[3] == names[0]
    assert warmwire.warm_sockets(str(tmp_path / "gone")) == []


def test_a_client_tries_the_warm_workers_meant_for_its_local_rank_first(tmp_path: Path) -> None:
    for pid, rank in ((30, 1), (100, 0), (7, 1), (12, None), (50, 2)):
        Path(warmwire.warm_socket_path(str(tmp_path), pid, rank)).touch()
    assert Path(warmwire.warm_socket_path(str(tmp_path), 7, 1)).name == "warm-7.1.sock"
    names = {rank: [Path(p).name for p in warmwire.warm_sockets(str(tmp_path), rank)]
             for rank in (0, 1, 3)}
    assert names[1][:2] == ["warm-7.1.sock", "warm-30.1.sock"]  # its own, then the rest
    assert sorted(names[1][2:]) == ["warm-100.0.sock", "warm-12.sock", "warm-50.2.sock"]
    assert names[0][0] == "warm-100.0.sock"
    assert sorted(names[3]) == sorted(names[0])  # none of its own: every one, still tried
    assert len(names[3]) == 5


FAKE_WARM_WORKER = """
import os, sys, time
fd = int(sys.argv[sys.argv.index("-m") + 2].split("=")[1])
rank = sys.argv[sys.argv.index("-m") + 3].split("=")[1]
log = os.environ["FAKE_LOG"]
first = not os.path.exists(log + ".taken")
with open(log, "a") as handle:
    handle.write(rank + "\\n")
if rank == "1" and first:  # taken at once, as if a client attached: the pool replaces it
    open(log + ".taken", "w").close()
    os.write(fd, b"RT")
    os.close(fd)
    time.sleep(0.2)
    sys.exit(0)
os.write(fd, b"R")
time.sleep(60)
"""


def test_the_pool_replaces_a_taken_warm_worker_with_one_for_the_same_local_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "fake.py"
    script.write_text(FAKE_WARM_WORKER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    log = tmp_path / "ranks.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    pool = warmpool.WarmPool(str(python), 3)
    pool.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
                not log.exists() or len(log.read_text().split()) < 4 or pool.taken < 1):
            time.sleep(0.05)
        time.sleep(0.5)  # nothing more may come
        assert sorted(log.read_text().split()) == ["0", "1", "1", "2"]
        assert pool.taken == 1 and pool.started == 4
    finally:
        pool.close()


@pytest.mark.parametrize(("args", "size"), [
    (["--nproc-per-node=8"], 8), (["--nproc_per_node", "4"], 4), (["--nproc-per-node=gpu"], 1),
    ([], 1),
])
def test_the_pool_holds_one_warm_worker_per_local_rank(args: list[str], size: int) -> None:
    assert warmpool.pool_size(args) == size


def test_the_switch_is_one_or_zero_and_anything_else_names_it() -> None:
    assert warmpool.switched_on({"RTJ_WARM_WORKERS": "1"})
    assert not warmpool.switched_on({"RTJ_WARM_WORKERS": "0"})
    assert not warmpool.switched_on({})
    with pytest.raises(SystemExit, match="RTJ_WARM_WORKERS='yes'"):
        warmpool.switched_on({"RTJ_WARM_WORKERS": "yes"})


class _FakeWarmWorker:
    """A real listener at `warm-<pid>.sock` that answers one request as a warm worker does and
    keeps what it received."""

    def __init__(self, directory: Path, pid: int, answer: dict[str, Any]) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(warmwire.warm_socket_path(str(directory), pid))
        self.listener.listen(1)
        self.answer = answer
        self.request: warmwire.Request | None = None
        self.fd_count = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        self.listener.close()
        with conn:
            data, fds, _flags, _address = socket.recv_fds(conn, 1 << 20, 3)
            self.fd_count = len(fds)
            for fd in fds:
                os.close(fd)
            self.request = warmwire.Request.from_message(warmwire.Decoder().feed(data)[0])
            conn.sendall(warmwire.encode(self.answer))
            conn.recv(1)  # until the client closes


def test_the_client_hands_its_request_and_stdio_to_the_warm_worker_that_answers(
        tmp_path: Path) -> None:
    (tmp_path / "warm-1.sock").touch()  # a stale file nobody listens on: skipped
    warm = _FakeWarmWorker(tmp_path, 2, {"attached": 4242})
    request = warmwire.Request(args=["--preset", "tiny"], env={"RANK": "0"}, cwd="/", pid=9)
    claimed = attach.claim(str(tmp_path), request)
    assert claimed is not None
    sock, pid, _decoder = claimed
    sock.close()
    warm.thread.join(5)
    assert pid == 4242 and warm.request == request and warm.fd_count == 3


def test_a_refusal_sends_the_client_down_the_normal_path(tmp_path: Path) -> None:
    warm = _FakeWarmWorker(tmp_path, 3, {"refused": "PYTHONPATH differs"})
    request = warmwire.Request(args=[], env={}, cwd="/", pid=9)
    assert attach.claim(str(tmp_path), request) is None
    warm.thread.join(5)


def test_the_attach_client_imports_no_torch() -> None:
    code = ("import sys, rtj_trainer.warm.attach; "
            "print(sorted(m for m in ('torch', 'nvidia_resiliency_ext', 'pydantic') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "[]"


def test_a_hugging_face_models_modules_are_imported_by_the_warm_workers(tmp_path: Path) -> None:
    """`--set model.hf_path=DIR`: a warm worker also imports transformers and DIR's modeling
    module (2-5 s of imports that a restart otherwise pays); nothing for the GPT or an
    unreadable directory."""
    import importlib.util

    from rtj_trainer.warm.wire import model_preloads

    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    expected = ["transformers", "transformers.modeling_utils", "rtj_trainer.hfmodel",
                "transformers.models.qwen2.modeling_qwen2"]
    if importlib.util.find_spec("triton") is not None:  # the kernels' compiler, where it is
        expected += ["triton", "triton.language"]
    command = ["--nnodes=1", "--no-python", "python", "-m", "rtj_trainer", "--preset", "1b"]
    assert model_preloads([*command, "--set", f"model.hf_path={tmp_path}"]) == expected
    assert model_preloads([*command, f"--set=model.hf_path={tmp_path}"]) == expected
    assert model_preloads(command) == []
    assert model_preloads([*command, "--set", f"model.hf_path={tmp_path}/absent"]) == []
    import importlib

    for name in expected:  # each one exists
        importlib.import_module(name)


def test_the_device_warm_up_switch_is_on_unless_zero_and_anything_else_names_it() -> None:
    from rtj_trainer.warm import device

    assert device.switched_on({}) and device.switched_on({"RTJ_WARM_DEVICE": "1"})
    assert not device.switched_on({"RTJ_WARM_DEVICE": "0"})
    with pytest.raises(SystemExit, match="RTJ_WARM_DEVICE='on'"):
        device.switched_on({"RTJ_WARM_DEVICE": "on"})


def test_without_a_device_the_warm_up_does_nothing_and_says_why() -> None:
    import torch
    from rtj_trainer.warm import device, worker

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/gpu covers the warm-up there")
    assert device.warm_up(0) == {"skipped": "no CUDA device"}
    assert worker.warm_device(0) == ""  # nothing added to the attach line
    assert worker.warm_device(None) == ""  # not meant for a local rank: not even tried


def test_the_restarts_reclaim_wait_allows_for_the_warm_workers_contexts(tmp_path: Path) -> None:
    from rtj_trainer import keeper
    from rtj_trainer.launcher import shim

    (tmp_path / "keeper-0.json").write_text('{"cuda": true, "cuda_buffer_bytes": 1073741824}')
    assert shim.held_on_device(str(tmp_path), False)() == 1024 + keeper.CONTEXT_ALLOWANCE_MB
    assert shim.held_on_device(str(tmp_path), True)() == 1024 + 2 * keeper.CONTEXT_ALLOWANCE_MB
    assert shim.held_on_device(None, True)() == keeper.CONTEXT_ALLOWANCE_MB
