"""rtj_trainer.gloocut: a restart cuts the attempt's gloo connections, so that no rank waits out
gloo's timeout in a collective that will never complete (gloo has no abort)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from rtj_trainer import gloocut

pytestmark = pytest.mark.unit


def _connected_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted


def test_cut_shuts_down_the_connections_opened_since_the_snapshot_and_only_those() -> None:
    gloo = gloocut.GlooConnections()
    old_server, old_client, old_accepted = _connected_pair()
    before = gloocut.snapshot()
    server, client, accepted = _connected_pair()
    try:
        # Both ends of the new connection are this process's (one process here; in a trainer
        # each end is another rank's); the listening socket is not a connection.
        assert gloo.record(before) == 2
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.append(client.recv(10)))
        reader.start()  # blocked, as a rank in a collective whose peer never sends
        assert gloo.cut() == 2
        reader.join(timeout=10)
        assert not reader.is_alive() and received == [b""]  # the wait ended: connection closed
        assert gloo.cut() == 0  # cut once; the next attempt records its own
        # The connections that were there before the snapshot still work.
        old_client.sendall(b"ping")
        assert old_accepted.recv(4) == b"ping"
    finally:
        for s in (old_server, old_client, old_accepted, server, client, accepted):
            s.close()


def test_excluded_ports_and_a_clean_end_are_never_cut() -> None:
    gloo = gloocut.GlooConnections()
    before = gloocut.snapshot()
    server, client, accepted = _connected_pair()
    try:
        port = server.getsockname()[1]
        assert gloo.record(before, exclude_ports=frozenset({port})) == 0
        assert gloo.cut() == 0
        assert gloo.record(before) == 2
        gloo.forget()  # the process group was destroyed cleanly
        assert gloo.cut() == 0
        client.sendall(b"ok")
        assert accepted.recv(2) == b"ok"
    finally:
        for s in (server, client, accepted):
            s.close()


def test_a_connection_accepted_by_a_server_older_than_the_snapshot_is_not_recorded() -> None:
    """A Prometheus scrape of the rank's metrics endpoint during `init_process_group` is not a
    gloo connection: the endpoint listened before the snapshot. The scraper's end (another
    process on a cluster; this one here) is still new, and so recorded."""
    gloo = gloocut.GlooConnections()
    metrics = socket.create_server(("127.0.0.1", 0))
    before = gloocut.snapshot()
    scraper = socket.create_connection(metrics.getsockname())
    served, _ = metrics.accept()
    try:
        assert gloo.record(before) == 1
        assert gloo._recorded == {os.fstat(scraper.fileno()).st_ino}
    finally:
        gloo.forget()
        for s in (metrics, scraper, served):
            s.close()


RANK = textwrap.dedent("""
    import datetime, os, sys, threading, time
    import torch, torch.distributed as dist
    from rtj_trainer import gloocut
    rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    gloo = gloocut.GlooConnections()
    before = gloocut.snapshot()
    dist.init_process_group("gloo", store=dist.PrefixStore("a", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    gloo.record(before, exclude_ports=frozenset({port}))
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:  # alive, but never joins the next collective (a rank whose attempt ended)
        store.wait(["rank0-left"])
    else:
        if mode == "cut":  # the restart's abort step, from another thread
            threading.Timer(0.5, gloo.cut).start()
        try:
            dist.all_reduce(t)
            print("rank 0: completed")
        except RuntimeError as error:
            print("rank 0: raised:", error)
        store.set("rank0-left", "1")
    dist.destroy_process_group()
    # The next attempt's process group works (what the wrapper builds next).
    dist.init_process_group("gloo", store=dist.PrefixStore("b", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.ones(8)
    dist.all_reduce(t)
    print(f"rank {rank}: next group", t[0].item())
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_a_rank_blocked_in_a_gloo_collective_leaves_it_when_its_connections_are_cut(
        tmp_path: Path) -> None:
    """Real gloo, two processes: rank 0 waits in an all-reduce that rank 1 never joins. With
    its connections cut from another thread (as the wrapper's abort step does) the collective
    fails at once with gloo's "connection closed", not by its 60 s timeout, and a new process
    group works afterwards."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(port), "cut"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=100)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    assert "rank 0: raised:" in outputs[0] and "Connection closed" in outputs[0], outputs[0]
    assert "Timed out" not in outputs[0]
    assert "rank 0: next group 2.0" in outputs[0] and "rank 1: next group 2.0" in outputs[1]
