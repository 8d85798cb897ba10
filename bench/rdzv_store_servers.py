"""The servers of `bench.rdzv_store` and what this machine allows.

The two servers run as subprocesses (`python -c SERVER_BOOTSTRAP ...`, `start_server`), each on
a loopback socket bound before its TCPStore takes it: nvrx-control with the operator's own argv
(`operator_argv`), and the in-process wrapper's store as worker rank 0 would host it. `Server`
reads their CPU seconds and RSS from /proc (`Sampler` every SAMPLE_SECONDS); `usage_by_phase`,
`calls_and_server_cpu` (the server's CPU per store call) and `server_log` (what nvrx-control
logged) are what the JSON reports of them. `machine_limits` and `raise_fd_limit` are the
machine's side: threads, ephemeral ports, file descriptors. `Phase` is the error of a phase that
did not complete.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import StampedProcess

RUN_ID = "bench-rdzv-store"
"""The job's UID in the operator's argv (the rendezvous id)."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
SAMPLE_SECONDS = 0.2
PHASE_SPANS = {"connect": ("connect", "connected"), "round": ("round", "round-done"),
               "steady": ("steady", "steady-done"), "restart": ("restart", "restart-done"),
               "ranks": ("ranks", "ranks-done"), "all": ("connect", "end")}
"""Each phase as the parent's two marks of the servers (`Server.mark`) around it."""
CLOSED_ROUND = re.compile(r"nvrx-control closed rendezvous round (\d+)")
CONSTRAINT_OK = re.compile(r"Constraint ok: (\d+) participants.*\(fetch ([\d.]+)ms, "
                           r"check ([\d.]+)ms\)")

# The servers, started as `python -c SERVER_BOOTSTRAP <mode> <host> <port> <fds> <libuv> ...`:
# bind the listening socket to the loopback address first (TCPStore itself listens on every
# interface), then either run nvrx-control's own main with that socket, or serve the in-process
# wrapper's store as its rank 0 would (torch's TCPStore, master).
SERVER_BOOTSTRAP = r"""
import os, resource, signal, socket, sys, time
mode, host, port, fds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
libuv = sys.argv[5] == "1"
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if fds > hard:
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fds, fds))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
else:
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, fds), hard))
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind((host, port))
listener.listen(4096)
fd = listener.detach()
if mode == "nvrx-control":
    import functools
    from nvidia_resiliency_ext.fault_tolerance import control_plane
    control_plane.TCPStore = functools.partial(control_plane.TCPStore, master_listen_fd=fd,
                                               use_libuv=libuv)
    control_plane.main(sys.argv[6:])
else:
    from datetime import timedelta
    from torch.distributed import TCPStore
    store = TCPStore(host, port, world_size=int(sys.argv[6]), is_master=True,
                     wait_for_workers=False, timeout=timedelta(seconds=120), use_libuv=libuv,
                     master_listen_fd=fd)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("wrapper store serving", flush=True)
    while True:
        time.sleep(3600)
"""


class Phase(Exception):
    """A phase that did not complete (the message says which and why)."""


def machine_limits(args: argparse.Namespace) -> list[str]:
    """What this machine cannot do for the sizes asked: every client is a thread (a task, under
    pid_max) and a connection from 127.0.0.1 to one ip:port (one ephemeral port each; a
    launcher's probe holds a second one in TIME_WAIT)."""
    def read(path: str) -> list[int]:
        try:
            return [int(x) for x in Path(path).read_text().split()]
        except (OSError, ValueError):
            return []

    ranks = args.launchers * args.ranks_per_launcher
    rank_clients = min(ranks, args.rank_clients or ranks)
    problems = []
    low_high = read("/proc/sys/net/ipv4/ip_local_port_range")
    if len(low_high) == 2:
        ports = low_high[1] - low_high[0] + 1
        if 2 * args.launchers + 16 > ports:
            problems.append(f"{args.launchers} launchers need {2 * args.launchers} ephemeral "
                            f"ports to nvrx-control's port, there are {ports}")
        if rank_clients + 16 > ports:
            problems.append(f"{rank_clients} rank clients need as many ephemeral ports to the "
                            f"wrapper's store, there are {ports}: pass --rank-clients "
                            f"{ports * 3 // 4} or fewer")
    pid_max = read("/proc/sys/kernel/pid_max")
    if pid_max and max(args.launchers, rank_clients) + 1024 > pid_max[0]:
        problems.append(f"{max(args.launchers, rank_clients)} client threads at once, pid_max is "
                        f"{pid_max[0]}: pass --rank-clients {pid_max[0] // 2} or fewer")
    return problems


def raise_fd_limit(needed: int) -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (above it only where allowed); the new soft."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if needed > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, needed))
            return needed
        except (ValueError, OSError):
            pass
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard



# ---------------------------------------------------------------- the operator's argv


@dataclass(frozen=True)
class OperatorArgv:
    rendezvous: list[str]
    """nvrx-control's argv as the rendezvous pod runs it (POD_IP and the port filled in)."""
    trainer: list[str]
    """A trainer pod's argv (for its ft_launcher flags)."""
    rdzv_conf: str
    monitor_interval: float


def operator_argv(launchers: int, port: int) -> OperatorArgv:
    """The rendezvous and trainer argv the operator gives a job of `launchers` nodes."""
    from rtj_operator import launcher
    from rtj_operator.api.models import parse_job
    from rtj_operator.config import OperatorSettings
    from rtj_operator.podplan import plan_for

    job = parse_job({
        "apiVersion": "training.resilient.dev/v1alpha1", "kind": "ResilientTrainingJob",
        "metadata": {"name": "bench", "namespace": "bench", "uid": RUN_ID, "generation": 1},
        "spec": {"nodes": launchers, "image": "trainer:bench",
                 "checkpoint": {"claimName": "bench"}},
    })
    settings = OperatorSettings()
    plan = plan_for(job, settings)

    def local(arg: str) -> str:
        arg = arg.replace("$(POD_IP)", "127.0.0.1")
        return arg.replace(f"127.0.0.1:{settings.rendezvous_port}", f"127.0.0.1:{port}")

    rendezvous = [local(a) for a in launcher.rendezvous_argv(job, plan, settings)]
    trainer = [local(a) for a in launcher.trainer_argv(job, plan, settings)]
    return OperatorArgv(rendezvous, trainer, flag(trainer, "--rdzv-conf"),
                        float(flag(trainer, "--monitor-interval")))


def flag(argv: Sequence[str], name: str) -> str:
    """The value of `name=VALUE` in `argv`."""
    for arg in argv:
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise ValueError(f"{name} is not in {argv}")


# ---------------------------------------------------------------- the servers


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def proc_usage(pid: int) -> tuple[float, int, int]:
    """CPU seconds (user + system, every thread), RSS and peak RSS (VmHWM) in bytes."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return cpu, rss, hwm


class Server:
    """One server subprocess and its /proc samples."""

    def __init__(self, name: str, command: list[str], log_path: Path) -> None:
        self.name = name
        self.process = StampedProcess([sys.executable, "-c", SERVER_BOOTSTRAP, *command],
                                      log_path=log_path)
        self.samples: list[tuple[float, float, int]] = []
        self.peak_rss = 0
        self.marks: dict[str, tuple[float, float]] = {}

    @property
    def pid(self) -> int:
        return int(self.process.process.pid)

    def sample(self) -> None:
        try:
            cpu, rss, hwm = proc_usage(self.pid)
        except (OSError, ValueError, IndexError):
            return
        self.samples.append((time.monotonic(), cpu, rss))
        self.peak_rss = max(self.peak_rss, hwm)

    def mark(self, name: str) -> None:
        self.sample()
        if self.samples:
            self.marks[name] = self.samples[-1][:2]

    def usage(self, start: str, end: str) -> dict[str, Any]:
        if start not in self.marks or end not in self.marks:
            return {}
        (t0, c0), (t1, c1) = self.marks[start], self.marks[end]
        rss = [s[2] for s in self.samples if t0 <= s[0] <= t1]
        return {"seconds": round(t1 - t0, 3), "cpu_seconds": round(c1 - c0, 3),
                "cores": round((c1 - c0) / (t1 - t0), 3) if t1 > t0 else None,
                "rss_mib_max": round(max(rss) / 2**20, 1) if rss else None}


class Sampler(threading.Thread):
    def __init__(self, servers: Iterable[Server]) -> None:
        super().__init__(daemon=True, name="sampler")
        self.servers = list(servers)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(SAMPLE_SECONDS):
            for server in self.servers:
                server.sample()


def start_server(servers: dict[str, Server], name: str, args: list[str], work: Path,
                 ready: str, what: str) -> None:
    """Start server `name` (`python -c SERVER_BOOTSTRAP name ARGS`, its log in `work`), in
    `servers` at once (stopped whatever follows), and wait for its `ready` line."""
    server = Server(name, [name, *args], work / f"{name}.log")
    servers[name] = server
    if server.process.wait_for_line(lambda t: ready in t, 120) is None:
        raise Phase(f"{what} did not start (log: {server.process.log_path})")


def stop_servers(servers: dict[str, Server], sampler: Sampler | None) -> None:
    """The sampler halted, then each server sampled a last time and stopped."""
    if sampler is not None:
        sampler.halt.set()
        sampler.join(5)
    for server in servers.values():
        server.sample()
        server.process.stop()


def server_log(control: Server | None, round_began: dict[int, float], clock_offset: float
               ) -> dict[str, Any]:
    """What nvrx-control logged: when it closed each round (seconds after the round began,
    from the line's arrival), its snapshots of the slots (`get_all_participants`)."""
    if control is None:
        return {}
    closes: dict[str, float] = {}
    fetches = []
    for line in control.process.lines:
        if (m := CLOSED_ROUND.search(line.text)) and int(m.group(1)) in round_began:
            began = round_began[int(m.group(1))]
            closes[m.group(1)] = round(line.at - clock_offset - began, 3)
        if m := CONSTRAINT_OK.search(line.text):
            fetches.append({"participants": int(m.group(1)), "fetch_ms": float(m.group(2)),
                            "check_ms": float(m.group(3))})
    return {"closed_round_seconds_after_its_start": closes, "host_snapshots": fetches}


def per_call(ops: dict[str, list[float]], usage: dict[str, Any]) -> dict[str, Any]:
    """The clients' store calls in a phase (RendezvousStoreInfo.build counted as its two reads)
    and the server's CPU per call: what the server costs per call, to scale by."""
    calls = sum(int(row[0]) * (2 if op == "store_info_build" else 1) for op, row in ops.items())
    cpu, seconds = usage.get("cpu_seconds"), usage.get("seconds")
    return {"calls": calls,
            "calls_per_second": round(calls / seconds, 1) if seconds else None,
            "server_cpu_us_per_call": round(1e6 * cpu / calls, 1) if calls and cpu else None}


def usage_by_phase(servers: dict[str, Server]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each server's seconds, CPU and RSS in each phase (between the parent's marks)."""
    return {name: {phase: server.usage(*span) for phase, span in PHASE_SPANS.items()
                   if server.usage(*span)}
            for name, server in servers.items()}


def calls_and_server_cpu(stats: dict[str, dict[str, list[float]]],
                         rank_stats: dict[str, dict[str, list[float]]] | None,
                         usage: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """`per_call` of nvrx-control in each launcher phase (`stats`: OpStats.table), and of the
    wrapper's store in the rank phase (every call of `rank_stats`, where there were ranks)."""
    load = {phase: per_call(stats.get(phase, {}), usage.get("nvrx-control", {}).get(phase, {}))
            for phase in ("connect", "round", "steady", "restart")}
    if rank_stats is not None:
        load["ranks"] = per_call(
            {op: row for ops in rank_stats.values() for op, row in ops.items()},
            usage.get("wrapper-store", {}).get("ranks", {}))
    return load
