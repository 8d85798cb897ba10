"""The simulated launchers of `bench.rdzv_store`: NVRx's rendezvous calls, one thread and
TCPStore client per launcher, in worker processes.

`WorkerSim` is one worker process: its launchers (connect, the rounds, the monitor polls, the
loss, the replacement; the order is the benchmark's docstring's), later its share of the ranks
(rdzv_store_ranks.RankClients), each phase started by a command from the parent. `worker_main`
is the process's entry point: the workers are started with the 'spawn' method, so it lives here,
importable by them. `Workers` is the parent's side: it spawns them and sends the commands;
`connect_figures`, `round_figures` and `restart_figures` turn the launchers' records into the
figures of their phases.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from .rdzv_store_ranks import OpStats, RankClients, TimedStore, error_text, spread
from .rdzv_store_servers import RUN_ID, Phase, raise_fd_limit

THREAD_STACK_BYTES = 512 * 1024


@dataclass
class Control:
    """What the worker's main thread tells one launcher thread."""

    wake: threading.Event = field(default_factory=threading.Event)
    lost: bool = False
    detector: bool = False
    polls: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class WorkerSim:
    """One worker process: its launchers (one thread and TCPStore client each), later its
    ranks. Results go to `results` as (phase, id, dict)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier as barrier
        from nvidia_resiliency_ext.fault_tolerance.c10d_monkey_patch import apply_c10d_patch
        from nvidia_resiliency_ext.fault_tolerance.config import FaultToleranceConfig
        from nvidia_resiliency_ext.fault_tolerance.launcher import LaunchConfig
        from rtj_trainer.nvrx import launcher as shim
        from torch.distributed.elastic.rendezvous.api import RendezvousParameters
        from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

        self.spec = spec
        self.barrier = barrier
        self.shim = shim
        self.n = int(spec["launchers"])
        self.monitor_interval = float(spec["monitor_interval"])
        os.environ.setdefault("TORCH_ELASTIC_WORKER_IDENTICAL", "1")  # ft_launcher's default
        apply_c10d_patch()  # ft_launcher's _register_ft_rdzv_handler
        shim.poll_rendezvous_rounds_faster()  # the shim's patch 2
        self._thread_pod = threading.local()
        # Each thread is its own pod: NVRx reads GROUP_RANK (the operator's pod index) from the
        # environment, which threads share.
        barrier.get_infrastructure_rank = self._group_rank  # type: ignore[attr-defined]
        configs = _parse_rendezvous_config(spec["rdzv_conf"])
        config = LaunchConfig(min_nodes=self.n, max_nodes=self.n,
                              nproc_per_node=max(1, int(spec["ranks_per_launcher"])),
                              fault_tol_cfg=FaultToleranceConfig(), run_id=RUN_ID,
                              rdzv_endpoint=spec["endpoint"], rdzv_backend="c10d",
                              rdzv_configs=configs, monitor_interval=self.monitor_interval)
        config.rdzv_configs["upscaling_enabled"] = True  # launch_agent
        self.params_kwargs = dict(config.rdzv_configs)
        self.params_kwargs["is_store_host"] = False
        self.params_kwargs["nproc_per_node"] = config.nproc_per_node
        self.params = RendezvousParameters(backend="c10d", endpoint=spec["endpoint"],
                                           run_id=RUN_ID, min_nodes=self.n, max_nodes=self.n,
                                           **self.params_kwargs)
        self.timeout = barrier.RendezvousTimeout(
            join=barrier._get_timeout(self.params, "join"),
            last_call=barrier._get_timeout(self.params, "last_call"),
            close=barrier._get_timeout(self.params, "close"))
        self.nodes = barrier._NodeDescGenerator()
        self.results: queue.Queue[tuple[str, int, dict[str, Any]]] = queue.Queue()
        self.stash: list[tuple[str, int, dict[str, Any]]] = []
        self.controls: dict[int, Control] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.go_round = threading.Event()
        self.stop = threading.Event()
        self.stats: list[OpStats] = []
        self.rank_clients = RankClients(self.results)

    def _group_rank(self, skip_nodename_logic: bool = False) -> int:
        return int(getattr(self._thread_pod, "group_rank", -1))

    # -- one launcher

    def start_launcher(self, index: int, group_rank: int, replacement: bool = False,
                       delay: float = 0.0) -> None:
        self.controls[index] = Control()
        thread = threading.Thread(target=self._launcher, name=f"launcher-{index}", daemon=True,
                                  args=(index, group_rank, replacement, delay))
        self.threads[index] = thread
        thread.start()

    def _connect(self, stats: OpStats, phase: str) -> tuple[Any, TimedStore, Any]:
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

        _backend, store = create_backend(self.params)  # probe, client, one compare_set
        timed = TimedStore(store, stats)
        timed.phase = phase
        state = self.barrier._RendezvousBarrierState(  # FtRendezvousBarrierHandler.__init__
            timed, RUN_ID, False, self.timeout.join.total_seconds(),
            self.timeout.last_call.total_seconds(), None, None, stale_check_interval=10.0)
        state._sync_from_per_round_state()  # set_agent -> _complete_initialization
        return store, timed, state

    def _rendezvous(self, store: Any, state: Any, node: Any, addr: str) -> dict[str, Any]:
        """`FtRendezvousBarrierHandler.next_rendezvous`: the barrier, then MASTER_ADDR/PORT."""
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

        joins: list[float] = []

        def pre_join_hook() -> None:  # where ft_launcher runs its health checks
            joins.append(time.monotonic())

        rank, total = state.perform_rendezvous(node, self.n, self.n,
                                               pre_join_hook=pre_join_hook)
        assigned = time.monotonic()
        view = SimpleNamespace(_settings=SimpleNamespace(run_id=RUN_ID),
                               _rendezvous_round=state._round, _store=store)
        prefixed = self.barrier.FtRendezvousBarrierHandler._get_store(view)
        began = time.perf_counter()
        info = RendezvousStoreInfo.build(rank, prefixed, local_addr=node.addr)
        state.store._stats.note(state.store.phase, "store_info_build",
                                time.perf_counter() - began)
        return {"join": joins[0] if joins else None, "joins": len(joins), "assigned": assigned,
                "ready": time.monotonic(), "rank": rank, "total": total, "round": state._round,
                "master": f"{info.master_addr}:{info.master_port}"}

    def _monitor(self, index: int, state: Any) -> str:
        """The agent's monitor loop between rounds: `is_next_round_open()` every interval."""
        control = self.controls[index]
        while True:
            if control.wake.wait(self.monitor_interval):
                control.wake.clear()  # the flags below were set before the wake-up
            if control.lost:
                return "lost"
            if self.stop.is_set():
                return "stop"
            if control.detector:
                control.detector = False
                return "detector"
            if state.is_next_round_open():
                return "open"
            control.polls += 1

    def _launcher(self, index: int, group_rank: int, replacement: bool, delay: float) -> None:
        self._thread_pod.group_rank = group_rank
        pod = index + 1
        addr = f"10.{pod >> 16 & 255}.{pod >> 8 & 255}.{pod & 255}"  # its pod IP
        control = self.controls[index]
        stats = OpStats()
        self.stats.append(stats)
        phase = "restart" if replacement else "connect"
        try:
            if delay > 0:
                time.sleep(delay)
            began = time.monotonic()
            store, timed, state = self._connect(stats, phase)
            node = self.nodes.generate(addr)
            agent = SimpleNamespace(_rdzv_handler=SimpleNamespace(
                _barrier_state=state, round=lambda: state._round))
            self.results.put((phase + "-connect" if replacement else "connect", index,
                              {"start": began, "end": time.monotonic()}))
            if replacement:
                self.shim.peer_stop_rounds_so_far(agent)  # the shim's _invoke_run
                self.results.put(("restart", index, {**self._rendezvous(store, state, node, addr),
                                                     "replacement": True}))
            else:
                self.go_round.wait()
                phase = timed.phase = "round"
                self.results.put(("round", index, self._rendezvous(store, state, node, addr)))
                phase = timed.phase = "steady"
                why = self._monitor(index, state)
                if why in ("lost", "stop"):
                    return
                phase = timed.phase = "restart"
                detected = time.monotonic()
                if why == "open":  # the agent's HEALTHY branch
                    state.get_shutdown_reason()  # no_restart_reason()
                # The shim's _handle_restart_decision, then NVRx's: the detector opens the round.
                self.shim.is_peer_stop_round(agent, state._round)
                if why == "detector":
                    state.open_rendezvous()
                self.results.put(("restart", index, {**self._rendezvous(store, state, node, addr),
                                                     "detected": detected,
                                                     "detector": why == "detector"}))
            phase = timed.phase = "after"
            while self._monitor(index, state) not in ("lost", "stop"):
                pass
        except BaseException as exc:  # reported, the thread ends
            self.results.put((phase, index, {"error": error_text(exc)}))
        finally:
            control.done.set()

    # -- commands from the parent

    def collect(self, phase: str, expected: int, timeout: float
                ) -> list[tuple[int, dict[str, Any]]]:
        """Results of `phase`: `expected` of them, or those that came within `timeout`."""
        got = [(i, r) for p, i, r in self.stash if p == phase]
        self.stash = [item for item in self.stash if item[0] != phase]
        deadline = time.monotonic() + timeout
        while len(got) < expected:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                p, i, r = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if p == phase:
                got.append((i, r))
            else:
                self.stash.append((p, i, r))
        return got

    def handle(self, command: str, arg: dict[str, Any]) -> dict[str, Any]:
        timeout = float(self.spec["phase_timeout"])
        if command == "connect":
            for index in self.spec["indices"]:
                self.start_launcher(index, index)
            return {"results": self.collect("connect", len(self.spec["indices"]), timeout)}
        if command == "round":
            self.go_round.set()
            return {"results": self.collect("round", len(self.spec["indices"]), timeout)}
        if command == "polls":
            return {"polls": sum(c.polls for c in self.controls.values())}
        if command == "lose":
            control = self.controls[arg["index"]]
            control.lost = True
            control.wake.set()
            control.done.wait(timeout)
            self.threads[arg["index"]].join(timeout)
            return {"closed": time.monotonic()}
        if command == "restart":
            expected = 0
            for index in self.spec["indices"]:
                if index == arg["detector"]:
                    self.controls[index].detector = True
                    self.controls[index].wake.set()
                if index != arg["lost"]:
                    expected += 1
            if arg["lost"] in self.spec["indices"]:
                self.start_launcher(arg["replacement"], arg["lost"], replacement=True,
                                    delay=arg["delay"])
                expected += 1
            return {"results": self.collect("restart", expected, timeout),
                    "replacement_connect": self.collect("restart-connect", 0, 0)}
        if command == "num-keys":  # a client of its own, as an operator's probe would be
            from torch._C._distributed_c10d import TCPStore

            host, port = self.spec["endpoint"].rsplit(":", 1)
            probe = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=30))
            return {"keys": int(probe.num_keys())}
        if command == "stop-launchers":
            self.stop.set()
            for control in self.controls.values():
                control.wake.set()
            for thread in self.threads.values():
                thread.join(timeout)
            merged = OpStats.merged(self.stats)
            while True:  # whatever was reported outside a phase's collection (late errors)
                try:
                    self.stash.append(self.results.get_nowait())
                except queue.Empty:
                    break
            return {"stats": merged.table, "late": self.stash}
        if command == "ranks-connect":
            self.rank_clients.start(arg)
            return {"results": self.collect("ranks-connect", len(arg["clients"]), timeout)}
        if command == "ranks-run":
            self.rank_clients.go.set()
            got = self.collect("ranks-run", len(self.rank_clients.threads), timeout)
            for thread in self.rank_clients.threads:
                thread.join(5)
            return {"results": got, "stats": OpStats.merged(self.rank_clients.stats).table}
        raise ValueError(f"unknown command {command}")


def worker_main(conn: Connection, spec: dict[str, Any]) -> None:
    """A worker process: builds its WorkerSim, then answers the parent's commands."""
    raise_fd_limit(int(spec["fds"]))
    threading.stack_size(THREAD_STACK_BYTES)
    # c10d's per-connection warnings (thousands of clients) would drown the summary; the
    # clients' errors are reported in the JSON.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import logging

    logging.getLogger("nvrx").setLevel(logging.ERROR)
    try:
        sim = WorkerSim(spec)
    except BaseException as exc:
        conn.send({"error": error_text(exc)})
        return
    conn.send({"ready": True, "cpu": time.process_time()})
    while True:
        command, arg = conn.recv()
        if command == "quit":
            break
        try:
            reply = sim.handle(command, arg)
        except BaseException as exc:
            reply = {"error": error_text(exc)}
        reply["cpu"] = time.process_time()
        conn.send(reply)


class Workers:
    """The parent's side of the worker processes: each spawned with `worker_main`, then sent
    commands over its pipe, one reply each."""

    def __init__(self, phase_timeout: float) -> None:
        self.phase_timeout = phase_timeout
        self.processes: list[tuple[Any, Connection, list[int]]] = []

    def __len__(self) -> int:
        return len(self.processes)

    def start(self, specs: Sequence[dict[str, Any]], client_cpu: dict[str, float]) -> None:
        """One worker per spec; waits for each to be ready (its CPU seconds so far, the imports,
        added to `client_cpu["imports"]`)."""
        context = multiprocessing.get_context("spawn")
        for w, spec in enumerate(specs):
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(child, spec), daemon=True,
                                      name=f"rdzv-worker-{w}")
            process.start()
            child.close()
            self.processes.append((process, parent, spec["indices"]))
        for _process, conn, _ in self.processes:
            reply = self.receive(conn, 300, "start")
            if "error" in reply:
                raise Phase(f"a worker did not start: {reply['error']}")
            client_cpu["imports"] = round(client_cpu.get("imports", 0.0) + reply["cpu"], 3)

    @staticmethod
    def receive(conn: Connection, timeout: float, phase: str) -> dict[str, Any]:
        if not conn.poll(timeout):
            raise Phase(f"{phase}: a worker did not answer within {timeout:g} s")
        reply: dict[str, Any] = conn.recv()
        return reply

    def command(self, phase: str, command: str, arg: dict[str, Any] | None = None,
                only: Iterable[int] | None = None,
                per_worker: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Send `command` to the workers (every one, or those in `only`; `per_worker`: each its
        own argument) and return their replies."""
        chosen = list(only) if only is not None else list(range(len(self.processes)))
        for w in chosen:
            self.processes[w][1].send((command, per_worker[w] if per_worker else arg or {}))
        replies = [self.receive(self.processes[w][1], self.phase_timeout + 60, phase)
                   for w in chosen]
        for reply in replies:
            if "error" in reply:
                raise Phase(f"{phase}: {reply['error']}")
        return replies

    def stop(self) -> None:
        """Every worker told to quit, and killed if it has not within 10 s."""
        for _process, conn, _ in self.processes:
            try:
                conn.send(("quit", {}))
            except OSError:
                pass
        for process, _, _ in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)


def connect_figures(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The connect phase's figures from the launchers' records."""
    ok = [r for r in records.values() if "error" not in r]
    latencies = sorted(r["end"] - r["start"] for r in ok)
    return {"connected": len(ok), "seconds": round(max(r["end"] for r in ok)
                                                   - min(r["start"] for r in ok), 3)
            if ok else None, "per_launcher_seconds": spread(latencies)}


def round_figures(records: dict[int, dict[str, Any]], n: int, lost: int, start: float | None,
                  expected_round: int, round_began: dict[int, float]) -> dict[str, Any]:
    """A round's figures from its launchers' records (a replacement, index `n`, takes pod index
    `lost`); its start (`start`, else the first join) goes to `round_began`."""
    ok = {i: r for i, r in records.items() if "error" not in r}
    joins = [r["join"] for r in ok.values() if r.get("join") is not None]
    began = start if start is not None else (min(joins) if joins else None)
    ranks = [r["rank"] for r in ok.values()]
    if began is not None:
        round_began[expected_round] = began
    figures: dict[str, Any] = {
        "completed": len(ok), "expected": n,
        "seconds": round(max(r["ready"] for r in ok.values()) - began, 3)
        if ok and began is not None and len(ok) == n else None,
        "first_join_to_last_join_seconds": round(max(joins) - min(joins), 3)
        if joins else None,
        "last_rank_assigned_seconds": round(max(r["assigned"] for r in ok.values())
                                            - began, 3) if ok and began else None,
        "ranks_distinct": len(set(ranks)) == len(ranks),
        "ranks_are_0_to_n": sorted(ranks) == list(range(n)),
        "world_sizes": sorted({r["total"] for r in ok.values()}),
        "rounds": sorted({r["round"] for r in ok.values()}),
        "rank_is_pod_index": all(r["rank"] == (lost if i >= n else i) for i, r in ok.items()),
        "retries": sum(max(0, r["joins"] - 1) for r in ok.values()),
        "masters": sorted({r["master"] for r in ok.values()}),
    }
    figures["assignment_ok"] = (figures["ranks_distinct"] and figures["ranks_are_0_to_n"]
                                and figures["world_sizes"] == [n]
                                and figures["rounds"] == [expected_round]
                                and len(figures["masters"]) == 1)
    return figures


def restart_figures(records: dict[int, dict[str, Any]], replies: list[dict[str, Any]],
                    closed: float, lost: int, detector: int, delay: float) -> dict[str, Any]:
    """What the restart round adds to its round's figures: the loss (at `closed`), who saw it
    when, the replacement."""
    detected = [r["detected"] for r in records.values() if "detected" in r]
    connects = [r for reply in replies for _, r in reply["replacement_connect"]]
    return {
        "lost_launcher": lost, "detector": detector,
        "replacement_delay_seconds": delay,
        "last_survivor_saw_the_round_open_seconds": round(max(detected) - closed, 3)
        if detected else None,
        "replacement_connect_seconds": round(connects[0]["end"] - connects[0]["start"], 3)
        if connects else None,
        "replacement_got_lost_rank": any(r.get("replacement") and r.get("rank") == lost
                                         for r in records.values()),
    }
