"""Pieces every benchmark shares: a subprocess whose output lines are time-stamped as they arrive,
cleanup that finds every process a run started (even re-parented ones), summary statistics and a
plain-text table.

Why stamp lines on arrival: the trainer's own prints carry no clock, and the benchmarks need the
moment each milestone (a restart event, a resume) happened. Output is unbuffered
(PYTHONUNBUFFERED=1), so the arrival time is the print time to within milliseconds.

Why a token in the environment: ft_launcher starts each worker in its own session and the
workers spawn checkpoint writers, so neither a process group nor the process tree (children are
re-parented when a parent dies) reliably names everything a run started. Every process inherits
`RTJ_BENCH_TOKEN=<uuid>`, and cleanup kills exactly the processes that carry this run's token.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN_VARIABLE = "RTJ_BENCH_TOKEN"


@dataclass(frozen=True, slots=True)
class StampedLine:
    at: float
    """Unix time the line arrived."""
    text: str


def processes_with_token(token: str) -> list[int]:
    """PIDs of live processes whose environment holds RTJ_BENCH_TOKEN=token (not this one)."""
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_token_processes(token: str, *, grace_seconds: float = 3.0) -> int:
    """SIGTERM then SIGKILL every process carrying `token`; returns how many there were."""
    pids = processes_with_token(token)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and processes_with_token(token):
        time.sleep(0.1)
    for pid in processes_with_token(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


class StampedProcess:
    """A subprocess (stdout and stderr merged) whose lines are stamped and logged as they come.

    The log file holds `<unix time> <line>` per line. `stop()` ends every process the run started.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO_ROOT,
    ) -> None:
        self.token = uuid.uuid4().hex
        full_env = dict(os.environ if env is None else env)
        full_env[TOKEN_VARIABLE] = self.token
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.lines: list[StampedLine] = []
        self._changed = threading.Condition()
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        self.process = subprocess.Popen(
            list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
            cwd=cwd, text=True, errors="replace", bufsize=1, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with open(self.log_path, "w") as log:
            for raw in self.process.stdout:
                line = StampedLine(time.time(), raw.rstrip("\n"))
                log.write(f"{line.at:.3f} {line.text}\n")
                log.flush()
                with self._changed:
                    self.lines.append(line)
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(
        self, predicate: Callable[[str], bool], timeout_seconds: float
    ) -> StampedLine | None:
        """The first line (already seen or still to come) matching `predicate`, or None when the
        output ends or the timeout passes first."""
        deadline = time.monotonic() + timeout_seconds
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if predicate(line.text):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (not self._reader.is_alive() and seen == len(self.lines)):
                    return None
                self._changed.wait(min(left, 0.5))

    def wait(self, timeout_seconds: float) -> int | None:
        """The exit code, or None if it is still running after the timeout."""
        try:
            return self.process.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int:
        """End the launcher and everything it started; returns how many processes were ended."""
        ended = kill_token_processes(self.token)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=5)
        return ended


def describe_spread(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """median/min/max/n of the values that are present (None = not measured in that run)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {
        "median": round(statistics.median(present), 3),
        "min": round(min(present), 3),
        "max": round(max(present), 3),
        "n": len(present),
    }


def format_spread(spread: Mapping[str, Any]) -> str:
    """`12.3 (11.0-14.2)` or `12.3` for one sample, `-` for none."""
    if not spread.get("n"):
        return "-"
    if spread["n"] == 1 or spread["min"] == spread["max"]:
        return f"{spread['median']:.2f}"
    return f"{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table, column widths padded so it also reads as plain text."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def source_fingerprint(*packages: str) -> str:
    """sha256 over the Python sources of the given folders (relative to the repository), so a
    result can say which code produced it and whether that code changed during the run."""
    import hashlib

    digest = hashlib.sha256()
    for package in packages:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(REPO_ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


TRAINER_SOURCES = ("trainer/rtj_trainer", "trainer/scripts")
OPERATOR_SOURCES = ("operator/rtj_operator",)


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on (cores, memory, load at the start, versions)."""
    memory_kib = 0
    try:
        for row in Path("/proc/meminfo").read_text().splitlines():
            if row.startswith("MemTotal:"):
                memory_kib = int(row.split()[1])
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
        info["nvidia_resiliency_ext"] = version("nvidia-resiliency-ext")
    except Exception:  # version lookup is informational only
        pass
    return info


def write_json(path: Path | None, data: Any) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def add_output_arguments(parser: argparse.ArgumentParser, *, work_dir_help: str) -> None:
    """`--work-dir` and `--out`, the same in every benchmark."""
    parser.add_argument("--work-dir", type=Path, default=None, help=work_dir_help)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")


def add_local_run_arguments(parser: argparse.ArgumentParser, *, run_timeout: float) -> None:
    """Options of the benchmarks that run trainer/scripts/train-local.sh."""
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra trainer override, e.g. model.d_model=128 (repeatable)")
    parser.add_argument("--run-timeout", type=float, default=run_timeout,
                        help=f"give up on one run after this many seconds "
                             f"(default {run_timeout:g})")
    add_output_arguments(
        parser, work_dir_help="where run directories and logs go (default: a new temp dir)"
    )
