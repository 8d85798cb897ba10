"""What the attach client (rtj_trainer.warm.attach), the warm worker (rtj_trainer.warm.worker) and
the launcher shim's pool (rtj_trainer.launcher.warmpool) agree on: the pool directory's file names,
the messages on a warm worker's socket, the argv rewrite and the mapping of a warm worker's end to
the client's exit. Standard library only and free of side effects: the attach client imports it, and
its import must stay in the tens of milliseconds (no torch anywhere on the path).

**The pool directory** (`POOL_DIR_ENV`, a private directory of mode 0700 made by the shim). A
warm worker listens on `warm-<pid>.sock` there from its start, before its imports; it accepts
once they are done, and the first client it accepts gets it (it then unlinks the file and closes
its listener, so the other clients waiting on it are refused and try the next one). A client
tries the warm workers in a rotation that starts at its local rank, so that local ranks started
together usually wait on different ones. A client that comes while the imports are still running
waits for them: they started before the client did, so they end sooner than the client's own
imports would (on a cold start the launcher starts the pool before it imports torch itself).

**Messages** are JSON objects, each framed by its length (4 bytes, big-endian). The client sends
one request (`Request`, with its stdin, stdout and stderr attached as SCM_RIGHTS) and then nothing
more: its end of the socket closing is the signal that it died. The warm worker answers
`{"attached": pid}` (it took over; signals go to that pid) or `{"refused": reason}` (the client
runs the normal path), and at its end `{"exit": code}`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rtj_wire import env

POOL_DIR_ENV = env.WARM_POOL_DIR
"""Set by the launcher shim for its workers: where the warm workers listen."""
SWITCH_ENV = env.WARM_WORKERS
"""`1` or `0`, read by the launcher shim: start workers from a pool of warm processes."""
SOCKET_PREFIX = "warm-"
SOCKET_SUFFIX = ".sock"
WORKER_MODULE = "rtj_trainer"
ATTACH_MODULE = "rtj_trainer.warm.attach"
MAX_MESSAGE_BYTES = 16 << 20
"""A request carries the worker's environment; anything larger is not one of ours."""
_LENGTH = struct.Struct(">I")

FORWARDED_TO_GROUP = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals torchelastic sends to a worker's process group (`os.killpg`); the client passes them
on to the warm worker's group, which holds its checkpoint writer as the worker's group did."""
FORWARDED_TO_PROCESS = (signal.SIGUSR1, signal.SIGUSR2)
"""Signals sent to the worker process only (the shim's stop signal, SIGUSR2, must not reach the
checkpoint writer: rtj_trainer.stop); passed on to the warm worker's pid only."""

STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "TORCHDYNAMO_", "TORCH_COMPILE",
                        "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES",
                        "CUDA_", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Variables read when the interpreter starts or torch is imported, i.e. before a warm worker
learns the worker's environment, and those read when CUDA starts and the caching allocator is
made, which a warm worker meant for a local rank does before attach (rtj_trainer.warm.device):
CUDA_VISIBLE_DEVICES, CUDA_MODULE_LOADING, CUDA_DEVICE_MAX_CONNECTIONS, ... A worker whose values
differ from the ones the warm worker was started with is refused and runs the normal path (a
launcher that gives each worker its own CUDA_VISIBLE_DEVICES is refused too: ours does not).
OMP_NUM_THREADS is applied at attach instead; TORCHINDUCTOR_* are read by torch.compile's config
at import, but the trainer compiles nothing (and torch itself sets TORCHINDUCTOR_CACHE_DIR in a
process's environment at run time, so it always differs)."""


class WireError(Exception):
    """A malformed message on a warm worker's socket."""


@dataclass(frozen=True, slots=True)
class Request:
    """What the client hands over: the worker's command-line arguments (after `-m rtj_trainer`),
    its environment, working directory and pid (the warm worker reads its start time)."""

    args: list[str]
    env: dict[str, str]
    cwd: str
    pid: int

    def encode(self) -> bytes:
        return encode({"args": self.args, "env": self.env, "cwd": self.cwd, "pid": self.pid})

    @staticmethod
    def from_message(message: Mapping[str, Any]) -> Request:
        args, env, cwd, pid = (message.get(key) for key in ("args", "env", "cwd", "pid"))
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
            raise WireError("request.args: expected a list of strings")
        if not (isinstance(env, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise WireError("request.env: expected an object of strings")
        if not isinstance(cwd, str) or not cwd:
            raise WireError("request.cwd: expected a directory")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise WireError("request.pid: expected a positive integer")
        return Request(args=args, env=env, cwd=cwd, pid=pid)


def encode(message: Mapping[str, Any]) -> bytes:
    """One framed message."""
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _LENGTH.pack(len(body)) + body


class Decoder:
    """Splits a byte stream into messages: `feed(chunk)` returns the messages completed."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self._buffer += chunk
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > MAX_MESSAGE_BYTES:
                raise WireError(f"message length {length} exceeds {MAX_MESSAGE_BYTES}")
            if len(self._buffer) < _LENGTH.size + length:
                break
            body = self._buffer[_LENGTH.size:_LENGTH.size + length]
            self._buffer = self._buffer[_LENGTH.size + length:]
            try:
                message = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise WireError(f"message is not JSON: {exc}") from None
            if not isinstance(message, dict):
                raise WireError("message is not a JSON object")
            messages.append(message)
        return messages

    @property
    def pending(self) -> int:
        """Bytes of an unfinished message."""
        return len(self._buffer)


def attach_argv(launcher_args: Sequence[str]) -> tuple[list[str], str] | None:
    """ft_launcher's arguments with the worker command `<python> -m rtj_trainer ...` (after
    `--no-python`) turned into `<python> -m rtj_trainer.warm.attach ...`, and that python; None when
    the arguments hold no such worker command (warm workers then do not apply)."""
    args = list(launcher_args)
    try:
        start = args.index("--no-python") + 1
    except ValueError:
        return None
    if args[start + 1:start + 3] != ["-m", WORKER_MODULE] or not args[start:start + 1]:
        return None
    python = args[start]
    args[start + 2] = ATTACH_MODULE
    return args, python


PRELOAD_ENV = "RTJ_WARM_PRELOAD"
"""Set by the pool for its warm workers: more modules to import ahead of time, comma-separated
(`model_preloads`)."""
HF_PATH_SETTING = "model.hf_path="


def model_preloads(launcher_args: Sequence[str]) -> list[str]:
    """The modules a worker of this command imports to build its model that a warm worker does
    not import anyway: for `--set model.hf_path=DIR`, transformers and the modeling module of
    DIR's `model_type` (2-5 s of imports, otherwise paid inside every restart). Nothing when the
    directory or its config cannot be read (the worker reports that itself)."""
    args = list(launcher_args)
    path = None
    for index, arg in enumerate(args):
        value = arg.removeprefix("--set=")
        if value.startswith(HF_PATH_SETTING):
            path = value.removeprefix(HF_PATH_SETTING)
        elif arg == "--set" and index + 1 < len(args) and args[index + 1].startswith(
                HF_PATH_SETTING):
            path = args[index + 1].removeprefix(HF_PATH_SETTING)
    if not path:
        return []
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return []
    kind = config.get("model_type") if isinstance(config, dict) else None
    modules = ["transformers", "transformers.modeling_utils", "rtj_trainer.hfmodel"]
    if isinstance(kind, str) and kind.isidentifier():
        modules.append(f"transformers.models.{kind}.modeling_{kind}")
    if importlib.util.find_spec("triton") is not None:  # rtj_trainer.kernels on CUDA
        modules += ["triton", "triton.language"]
    return modules


def startup_env_mismatch(worker: Mapping[str, str], warm: Mapping[str, str]) -> str | None:
    """The first variable read at interpreter start or torch import whose value differs between
    the worker's environment and the warm worker's (None: they agree)."""
    names = {name for env in (worker, warm) for name in env
             if name.startswith(STARTUP_ENV_PREFIXES)}
    for name in sorted(names):
        if worker.get(name) != warm.get(name):
            return name
    return None


@dataclass(frozen=True, slots=True)
class Ending:
    """How the client ends: exit with `code`, or die by `signal` (as the worker would have)."""

    code: int | None = None
    signal: int | None = None


def ending(exit_message: Mapping[str, Any] | None, forwarded: int | None) -> Ending:
    """The client's end once its socket closed. With the warm worker's `{"exit": code}`: that
    code. Without one the warm worker died by a signal the client cannot see (it is not its
    parent): the last terminating signal the client passed on (SIGTERM from a restart: the
    default action ends the worker, as it did a worker started the normal way), else SIGKILL
    (killed from outside: its rank monitor, the OOM killer, a fault drill). torchelastic then
    sees the same -SIG return code as for a worker started the normal way."""
    if exit_message is not None:
        code = exit_message.get("exit")
        if isinstance(code, int) and not isinstance(code, bool):
            return Ending(code=code & 0xFF)
    if forwarded in (int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP),
                     int(signal.SIGUSR1), int(signal.SIGUSR2)):
        return Ending(signal=forwarded)
    return Ending(signal=int(signal.SIGKILL))


def warm_sockets(pool_dir: str, local_rank: int = 0) -> list[str]:
    """Paths of the warm workers listening now: first those meant for `local_rank` (their
    device warmed for it, rtj_trainer.warm.device), then the others in pid order rotated to
    start at `local_rank` (modulo their number), so that ranks start their search apart."""
    try:
        names = os.listdir(pool_dir)
    except OSError:
        return []
    found = sorted((n for n in names if n.startswith(SOCKET_PREFIX) and n.endswith(SOCKET_SUFFIX)),
                   key=lambda n: _parse(n)[0])
    if not found:
        return []
    own = [n for n in found if _parse(n)[1] == local_rank]
    start = local_rank % len(found)
    others = [n for n in found[start:] + found[:start] if n not in own]
    return [os.path.join(pool_dir, n) for n in own + others]


def _parse(name: str) -> tuple[int, int | None]:
    """(pid, local rank or None) of `warm-<pid>[.<rank>].sock`; pid 0 when unreadable."""
    pid, _, rank = name[len(SOCKET_PREFIX):-len(SOCKET_SUFFIX)].partition(".")
    try:
        return int(pid), (int(rank) if rank else None)
    except ValueError:
        return 0, None


def warm_socket_path(pool_dir: str, pid: int, local_rank: int | None = None) -> str:
    """`warm-<pid>.sock`, or `warm-<pid>.<rank>.sock` for a warm worker meant for a local rank."""
    rank = "" if local_rank is None else f".{local_rank}"
    return os.path.join(pool_dir, f"{SOCKET_PREFIX}{pid}{rank}{SOCKET_SUFFIX}")
