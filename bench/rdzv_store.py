"""The rendezvous store under load (issue #33, item 3): many launchers, one nvrx-control.

    python -m bench.rdzv_store --launchers 200 --out F
    python -m bench.rdzv_store --launchers 5000 --ranks-per-launcher 8 --rank-clients 10000 \
        --barrier-timeout 1200 --phase-timeout 1800 --out F

The server is the one the rendezvous pod runs: `nvrx-control` with the operator's own argv
(rtj_operator.launcher.rendezvous_argv for a job of `--launchers` nodes), in a subprocess on
127.0.0.1 and a free port. Its TCPStore would listen on every interface (torch binds `::` whatever
the host name), so the listening socket is bound to 127.0.0.1 first and handed to the same
TCPStore call (`master_listen_fd`); nothing else of nvrx-control changes. Its CPU seconds and RSS
come from /proc/<pid>.

The launchers are threads in `--workers` processes, one TCPStore client each, making NVRx's own
calls, in the order ft_launcher (through rtj_trainer.launcher's shim) makes them:

- connect: torch's `create_backend` with NVRx's `_patched_create_tcp_store` (c10d_monkey_patch:
  the probe, then a TCPStore client) and `C10dRendezvousBackend` (one compare_set), with the
  rendezvous parameters ft_launcher builds (NVRx's `LaunchConfig` defaults plus the operator's
  `--rdzv-conf`); then `_RendezvousBarrierState(...)` and `_sync_from_per_round_state()`, as
  `FtRendezvousBarrierHandler.__init__` and `set_agent` do (the handler itself is not built: each
  one binds the process's one ft_launcher IPC socket path);
- a round: `_RendezvousBarrierState.perform_rendezvous` (Steps 0-3: join_count add, two
  round-fenced compare_sets, polling round_done) and then `RendezvousStoreInfo.build` on
  `FtRendezvousBarrierHandler._get_store` (MASTER_ADDR/PORT), as `next_rendezvous` does;
  TORCH_ELASTIC_WORKER_IDENTICAL=1 (ft_launcher's default) leaves torchelastic's rank
  assignment without store calls. The shim's faster round polls (0.2 s) are on.
- between rounds: `is_next_round_open()` every `--monitor-interval` of the trainer's argv
  (the agent's monitor loop);
- a lost launcher: its connection closes; at that moment one survivor (its workers failed) opens
  the next round (`open_rendezvous`, after the shim's peer-stop check; the time to notice the
  failure is not part of the figure), the others see it at their next poll
  (`get_shutdown_reason`, the shim's check) and rendezvous again; a replacement launcher with the
  lost pod's GROUP_RANK connects as a new pod does (and the shim's `peer_stop_rounds_so_far`)
  and joins the same round.

Each launcher thread is its own pod: GROUP_RANK (the operator's pod index, NVRx's infrastructure
rank) is read per thread, and its address is a distinct fake pod IP. The health checks that run
before the join (NVML) make no store calls and are left out. Every store call is timed by name.

With `--ranks-per-launcher` P, the in-process wrapper's ranks follow: their store is not
nvrx-control's but the wrapper's own TCPStore, hosted by worker rank 0 (side_store_ports)
(rtj_trainer.nvrx.inprocess). A second subprocess serves it the same way (torch's TCPStore,
libuv, 127.0.0.1), and `launchers x P` ranks, as `nvidia_resiliency_ext.inprocess.store.TCPStore`
clients (the trainer's store_kwargs), make what `CallWrapper` makes: the initial barrier and
`set_initial_rank`, the first iteration's `set_initial_rank`, then after a fault the iteration
(reentrant) barrier and `get_terminated_ranks`, each through StoreMixin. With
`--rank-clients` C < ranks, each client carries ranks/C ranks: every rank makes its own calls,
and only the last of a client's ranks waits in the barrier (NVRx's own timeout-0 form for the
others, as its sibling monitor uses). One client per rank needs a thread (pid_max) and an
ephemeral port to one ip:port each: `machine_limits` says when this machine has too few. The
ranks' monitor processes (a second client each) and heartbeats are not simulated.

Phases: connect every launcher, round 0 (first join to the last launcher holding its rank and
MASTER_ADDR), `--steady-seconds` of monitor polls, the restart round (loss to the last launcher
ready again), then the ranks. The JSON has the seconds of each, the servers' CPU and RSS per
phase, the store calls by name and phase and the server's CPU per call, the clients' CPU and
every client-side error. Simulated clients cost CPU on the same machine: compare the servers'
cores with the clients' CPU seconds before calling the store the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import add_output_arguments, format_table, machine_description, write_json
from .rdzv_store_launchers import Workers, connect_figures, restart_figures, round_figures
from .rdzv_store_ranks import OpStats, rank_barrier_figures, rank_clients_by_worker
from .rdzv_store_servers import (
    Phase,
    Sampler,
    Server,
    calls_and_server_cpu,
    free_port,
    machine_limits,
    operator_argv,
    raise_fd_limit,
    server_log,
    start_server,
    stop_servers,
    usage_by_phase,
)

TARGET_ROUND_SECONDS = 30.0
"""Issue #33: a rendezvous round of 5,000 launchers within 30 s."""
TARGET_RESTART_SECONDS = 10.0
"""Issue #33: the restart round after one lost node within 10 s."""
ERROR_SAMPLES = 20


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.rdzv_store", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", type=int, required=True,
                        help="trainer pods (ft_launchers) of the job")
    parser.add_argument("--ranks-per-launcher", type=int, default=0,
                        help="in-process wrapper ranks per launcher (0: no rank phase)")
    parser.add_argument("--rank-clients", type=int, default=0,
                        help="TCPStore connections the ranks use (default: one per rank)")
    parser.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                        help="processes the simulated clients are spread over (threads in each)")
    parser.add_argument("--steady-seconds", type=float, default=5.0,
                        help="monitor polls measured between the two rounds (default 5)")
    parser.add_argument("--lost-launcher", type=int, default=None,
                        help="pod index of the launcher lost (default: the middle one)")
    parser.add_argument("--replacement-delay", type=float, default=0.0,
                        help="seconds from the loss to the replacement's connect (default 0)")
    parser.add_argument("--barrier-timeout", type=float, default=300.0,
                        help="the ranks' barrier timeout in seconds (default 300)")
    parser.add_argument("--phase-timeout", type=float, default=900.0,
                        help="give up on a phase after this many seconds (default 900)")
    parser.add_argument("--server-backend", choices=("libuv", "legacy"), default="libuv",
                        help="TCPStore server backend (nvrx-control's default: libuv)")
    add_output_arguments(parser, work_dir_help="where the servers' logs go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.launchers < 2:
        parser.error("--launchers must be at least 2 (one is lost)")
    if args.ranks_per_launcher < 0 or args.rank_clients < 0 or args.workers < 1:
        parser.error("--ranks-per-launcher, --rank-clients >= 0, --workers >= 1")
    if args.lost_launcher is not None and not 0 <= args.lost_launcher < args.launchers:
        parser.error("--lost-launcher must be a pod index")
    problems = machine_limits(args)
    if problems:
        parser.error("this machine cannot hold that many clients: " + "; ".join(problems))
    return args


class Bench:
    """One run: the servers, the workers, the phases, what they measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n: int = int(args.launchers)
        self.ranks = args.launchers * args.ranks_per_launcher
        self.rank_clients = min(self.ranks, args.rank_clients or self.ranks)
        self.workers_n: int = min(int(args.workers), self.n)
        self.work = (args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-rdzv."))).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.argv = operator_argv(self.n, self.port)
        self.servers: dict[str, Server] = {}
        self.workers = Workers(args.phase_timeout)
        self.result: dict[str, Any] = {}
        self.errors: list[str] = []
        self.client_cpu: dict[str, float] = {}
        self.stats = OpStats()
        self.rank_stats = OpStats()
        self.clock_offset = time.time() - time.monotonic()
        self.libuv = "1" if args.server_backend == "libuv" else "0"
        self.sampler: Sampler | None = None
        self.round_began: dict[int, float] = {}
        """Round -> its start (time.monotonic()): the first join, the loss."""

    # -- servers and workers

    def start_servers(self) -> None:
        start_server(self.servers, "nvrx-control",
                     ["127.0.0.1", str(self.port), str(self.n + 1024), self.libuv,
                      *self.argv.rendezvous[1:]], self.work, "rendezvous loop started",
                     "nvrx-control")
        if self.ranks:
            self.rank_port = free_port()
            start_server(self.servers, "wrapper-store",
                         ["127.0.0.1", str(self.rank_port), str(self.rank_clients + 1024),
                          self.libuv, str(self.ranks)], self.work, "wrapper store serving",
                         "the wrapper's store")
        self.sampler = Sampler(self.servers.values())
        self.sampler.start()

    def start_workers(self) -> None:
        rank_share = -(-self.rank_clients // self.workers_n) if self.ranks else 0
        specs = []
        for w in range(self.workers_n):
            indices = list(range(w, self.n, self.workers_n))
            specs.append({"launchers": self.n, "indices": indices,
                          "endpoint": f"127.0.0.1:{self.port}", "rdzv_conf": self.argv.rdzv_conf,
                          "monitor_interval": self.argv.monitor_interval,
                          "ranks_per_launcher": self.args.ranks_per_launcher,
                          "phase_timeout": self.args.phase_timeout,
                          "fds": 2 * len(indices) + rank_share + 1024})
        self.workers.start(specs, self.client_cpu)

    def cpu_of(self, phase: str, before: list[dict[str, Any]], after: list[dict[str, Any]]
               ) -> None:
        self.client_cpu[phase] = round(sum(a["cpu"] for a in after)
                                       - sum(b["cpu"] for b in before), 3)

    def mark(self, name: str) -> None:
        for server in self.servers.values():
            server.mark(name)

    def owner(self, index: int) -> int:
        return index % self.workers_n

    def gather(self, replies: list[dict[str, Any]], phase: str
               ) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for reply in replies:
            for index, record in reply["results"]:
                out[index] = record
                if "error" in record:
                    self.errors.append(f"{phase} #{index}: {record['error']}")
        return out

    # -- the phases

    def phase_connect(self) -> None:
        before = self.workers.command("connect", "polls")
        self.mark("connect")
        records = self.gather(self.workers.command("connect", "connect"), "connect")
        self.mark("connected")
        self.cpu_of("connect", before, self.workers.command("connect", "polls"))
        self.result["connect"] = connect_figures(records)
        if (connected := self.result["connect"]["connected"]) < self.n:
            raise Phase(f"connect: {self.n - connected} of {self.n} launchers did not connect "
                        f"within {self.args.phase_timeout:g} s")

    def phase_round(self) -> None:
        before = self.workers.command("round", "polls")
        self.mark("round")
        records = self.gather(self.workers.command("round", "round"), "round")
        self.mark("round-done")
        self.cpu_of("round", before, self.workers.command("round", "polls"))
        self.result["round"] = round_figures(records, self.n, self.lost, None, 0, self.round_began)
        self.result["round_seconds"] = self.result["round"]["seconds"]
        if self.result["round"]["completed"] < self.n:
            raise Phase(f"round: {self.n - self.result['round']['completed']} of {self.n} "
                        "launchers got no rank")

    def phase_steady(self) -> None:
        before = self.workers.command("steady", "polls")
        self.mark("steady")
        time.sleep(self.args.steady_seconds)
        self.mark("steady-done")
        after = self.workers.command("steady", "polls")
        self.cpu_of("steady", before, after)
        polls = sum(a["polls"] for a in after) - sum(b["polls"] for b in before)
        wall = self.servers["nvrx-control"].usage("steady", "steady-done").get("seconds") or 1
        self.result["steady"] = {"seconds": self.args.steady_seconds,
                                 "monitor_interval_seconds": self.argv.monitor_interval,
                                 "is_next_round_open_per_second": round(polls / wall, 1)}

    def phase_restart(self) -> None:
        self.lost = self.args.lost_launcher if self.args.lost_launcher is not None else self.n // 2
        detector = (self.lost + 1) % self.n
        before = self.workers.command("restart", "polls")
        self.mark("restart")
        closed = self.workers.command("restart", "lose", {"index": self.lost},
                                      only=[self.owner(self.lost)])[0]["closed"]
        replies = self.workers.command("restart", "restart", {
            "lost": self.lost, "detector": detector, "replacement": self.n,
            "delay": self.args.replacement_delay})
        self.mark("restart-done")
        self.cpu_of("restart", before, replies)
        records = self.gather(replies, "restart")
        figures = round_figures(records, self.n, self.lost, closed, 1, self.round_began)
        figures.update(restart_figures(records, replies, closed, self.lost, detector,
                                       self.args.replacement_delay))
        self.result["restart_round"] = figures
        self.result["restart_round_seconds"] = figures["seconds"]
        if figures["completed"] < self.n:
            raise Phase(f"restart round: {self.n - figures['completed']} of {self.n} launchers "
                        "got no rank")

    def stop_launchers(self) -> None:
        self.mark("after")
        self.result["server_keys_after_two_rounds"] = self.workers.command(
            "stop", "num-keys", only=[0])[0]["keys"]
        replies = self.workers.command("stop", "stop-launchers")
        for reply in replies:
            self.stats.merge(reply["stats"])
            for phase, index, record in reply["late"]:
                if "error" in record:
                    self.errors.append(f"{phase} #{index}: {record['error']}")
        self.mark("stopped")

    def phase_ranks(self) -> None:
        per_client, clients, share = rank_clients_by_worker(self.ranks, self.rank_clients,
                                                            len(self.workers))
        arg = {"host": "127.0.0.1", "port": self.rank_port, "world": self.ranks,
               "barrier_timeout": self.args.barrier_timeout}
        before = self.workers.command("ranks", "polls")
        self.mark("ranks")
        connected = self.gather(self.workers.command(
            "ranks", "ranks-connect", per_worker=[{**arg, "clients": mine} for mine in share]),
            "ranks-connect")
        self.mark("ranks-connected")
        failed = sum(1 for r in connected.values() if "error" in r)
        if failed or len(connected) < len(clients):
            raise Phase(f"ranks: {failed or len(clients) - len(connected)} of {len(clients)} "
                        "rank clients did not connect")
        replies = self.workers.command("ranks", "ranks-run")
        self.mark("ranks-done")
        self.cpu_of("ranks", before, replies)
        records = self.gather(replies, "ranks-run")
        for reply in replies:
            self.rank_stats.merge(reply["stats"])
        self.result["rank_barriers"] = rank_barrier_figures(self.ranks, per_client, len(clients),
                                                            connected, records)
        self.result["rank_barrier_seconds"] = (
            self.result["rank_barriers"]["iteration_barrier_seconds"])

    # -- the whole run

    def run(self) -> dict[str, Any]:
        load_before = os.getloadavg()
        self.lost = self.args.lost_launcher if self.args.lost_launcher is not None else self.n // 2
        failure: str | None = None
        try:
            self.start_servers()
            self.start_workers()
            self.phase_connect()
            self.phase_round()
            self.phase_steady()
            self.phase_restart()
            self.stop_launchers()
            if self.ranks:
                self.phase_ranks()
            self.mark("end")
        except Phase as exc:
            failure = str(exc)
            self.mark("end")
        finally:
            self.stop()
        return self.report(failure, load_before)

    def stop(self) -> None:
        self.workers.stop()
        stop_servers(self.servers, self.sampler)

    def report(self, failure: str | None, load_before: tuple[float, float, float]
               ) -> dict[str, Any]:
        usage = usage_by_phase(self.servers)
        control = self.servers.get("nvrx-control")
        load = calls_and_server_cpu(self.stats.table,
                                    self.rank_stats.table if self.ranks else None, usage)
        counted = Counter(e.split(": ", 1)[1] if ": " in e else e for e in self.errors)
        result: dict[str, Any] = {
            "benchmark": "rdzv_store",
            "command": "python -m bench.rdzv_store " + shlex.join(self.args.argv),
            "launchers": self.n, "ranks_per_launcher": self.args.ranks_per_launcher,
            "ranks": self.ranks, "workers": len(self.workers) or self.workers_n,
            "completed": failure is None, "failure": failure,
            "round_seconds": self.result.get("round_seconds"),
            "restart_round_seconds": self.result.get("restart_round_seconds"),
            "rank_barrier_seconds": self.result.get("rank_barrier_seconds"),
            "server_cpu_seconds": usage.get("nvrx-control", {}).get("all", {}).get("cpu_seconds"),
            "server_cpu_seconds_total": (round(control.samples[-1][1], 3)
                                         if control and control.samples else None),
            "server_peak_rss_mib": round(control.peak_rss / 2**20, 1) if control else None,
            "client_errors": {"count": len(self.errors),
                              "by_message": dict(counted.most_common(ERROR_SAMPLES)),
                              "samples": self.errors[:ERROR_SAMPLES]},
            **{k: v for k, v in self.result.items() if not k.endswith("_seconds")},
            "targets": {
                "round_seconds_at_most": TARGET_ROUND_SECONDS,
                "round_met": _at_most(self.result.get("round_seconds"), TARGET_ROUND_SECONDS),
                "restart_round_seconds_at_most": TARGET_RESTART_SECONDS,
                "restart_round_met": _at_most(self.result.get("restart_round_seconds"),
                                              TARGET_RESTART_SECONDS),
                "note": "issue #33's targets are for 5,000 launchers",
            },
            "server": {
                "program": "nvrx-control", "argv": self.argv.rendezvous,
                "listen": f"127.0.0.1:{self.port}", "backend": self.args.server_backend,
                "pid_usage_by_phase": usage.get("nvrx-control", {}),
                "log": str(control.process.log_path) if control else None,
                **server_log(control, self.round_began, self.clock_offset),
            },
            "wrapper_store": ({"listen": f"127.0.0.1:{self.rank_port}",
                               "peak_rss_mib": round(self.servers["wrapper-store"].peak_rss
                                                     / 2**20, 1),
                               "pid_usage_by_phase": usage.get("wrapper-store", {})}
                              if "wrapper-store" in self.servers else None),
            "launcher_settings": {"trainer_argv": self.argv.trainer,
                                  "rdzv_conf": self.argv.rdzv_conf,
                                  "monitor_interval_seconds": self.argv.monitor_interval},
            "calls_and_server_cpu": load,
            "store_calls": self.stats.summary(),
            "rank_store_calls": self.rank_stats.summary(),
            "client_cpu_seconds": self.client_cpu,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "machine": machine_description(),
            "work_dir": str(self.work),
        }
        return result


def _at_most(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def summary(result: dict[str, Any]) -> str:
    """A few lines for people: the figures, the servers' cost per phase, the slowest calls."""
    def num(value: Any) -> str:
        return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

    usage = result["server"]["pid_usage_by_phase"]
    cpu = result["client_cpu_seconds"]
    phase_seconds = {"connect": (result.get("connect") or {}).get("seconds"),
                     "round": result["round_seconds"],
                     "steady": (result.get("steady") or {}).get("seconds"),
                     "restart": result["restart_round_seconds"],
                     "ranks": (result.get("rank_barriers") or {}).get("iteration_barrier_seconds")}
    rows = []
    for phase in ("connect", "round", "steady", "restart", "ranks"):
        u = usage.get(phase, {})
        w = ((result.get("wrapper_store") or {}).get("pid_usage_by_phase") or {}).get(phase, {})
        if not u and not w:
            continue
        rows.append([phase, num(phase_seconds[phase]), num(u.get("cpu_seconds")),
                     num(u.get("cores")), num(u.get("rss_mib_max")), num(w.get("cpu_seconds")),
                     num(cpu.get(phase))])
    lines = [
        f"[bench.rdzv_store] {result['launchers']} launchers x {result['ranks_per_launcher']} "
        f"ranks: round {num(result['round_seconds'])} s, restart round "
        f"{num(result['restart_round_seconds'])} s, rank iteration barrier "
        f"{num(result['rank_barrier_seconds'])} s; nvrx-control "
        f"{num(result['server_cpu_seconds'])} CPU s, peak RSS {num(result['server_peak_rss_mib'])}"
        f" MiB; {result['client_errors']['count']} client errors"
        + ("" if result["completed"] else f"; INCOMPLETE: {result['failure']}"),
        format_table(["phase", "seconds", "nvrx-control CPU s", "cores", "RSS MiB",
                      "wrapper store CPU s", "clients CPU s"], rows),
    ]
    calls = [(phase, op, row) for phase, ops in result["store_calls"].items()
             for op, row in ops.items() if phase in ("round", "restart")]
    calls.sort(key=lambda c: -c[2]["seconds"])
    if calls:
        lines.append("launchers' store calls by time spent (round, restart): " + ", ".join(
            f"{phase}/{op} {row['count']}x {row['mean_ms']:.2f} ms (max {row['max_ms']:.0f})"
            for phase, op, row in calls[:6]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    args.argv = raw
    raise_fd_limit(4096)
    result = Bench(args).run()
    text = json.dumps(result, indent=1, default=str)
    if args.out is not None:
        write_json(args.out, result)
    else:
        print(text)
    print(summary(result), flush=True)
    return 0 if result["completed"] and not result["client_errors"]["count"] else 1


if __name__ == "__main__":
    sys.exit(main())
