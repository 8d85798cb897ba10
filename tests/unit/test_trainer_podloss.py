"""The operator's verdicts on lost pods, on the trainer's side (rtj_trainer.podloss): the document
the shim accepts, the file it keeps, which ranks a verdict names, and the marking itself against
a real TCPStore with NVRx's own store API and barriers (the in-process wrapper's iteration
barrier completes for the lost ranks, as NVRx's sibling monitor would make it)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from nvidia_resiliency_ext.inprocess.attribution import Interruption
from nvidia_resiliency_ext.inprocess.state import Mode, State
from nvidia_resiliency_ext.inprocess.store import PrefixStore, StoreMixin
from rtj_trainer import podloss
from rtj_trainer.launcher import podmetrics
from rtj_trainer.launcher.verdicts import VerdictBook
from rtj_trainer.nvrx import store as wrapper_store
from rtj_trainer.nvrx.inprocess import patch_initial_ranks
from rtj_trainer.podloss import Outcome
from rtj_wire import lostpods
from rtj_wire.lostpods import LostPod, VerdictError
from torch._C._distributed_c10d import TCPStore

pytestmark = pytest.mark.unit

PODS = {"uid-a": (0, 1), "uid-b": (2, 3), "uid-c": (4, 5)}
"""Three pods of two ranks: pod C's ranks are the warm spare's (initial ranks 4 and 5)."""


# -- the document -------------------------------------------------------------------------------


def test_a_verdict_names_pods_by_uid() -> None:
    pods = lostpods.parse_verdict({"pods": [{"uid": "u1", "name": "job-1", "cause": "PodFailed"},
                                           {"uid": "u2"}]})
    assert pods == [LostPod("u1", "job-1", "PodFailed"), LostPod("u2", "", "")]


@pytest.mark.parametrize(("document", "field"), [
    ([], "expected a JSON object"),
    ({}, "pods: expected a list of 1 to 64"),
    ({"pods": []}, "pods: expected a list of 1 to 64"),
    ({"pods": [{"uid": f"u{n}"} for n in range(65)]}, "pods: expected a list of 1 to 64"),
    ({"pods": ["u1"]}, "pods[0]: expected an object"),
    ({"pods": [{"uid": "u1"}, {"name": "x"}]}, "pods[1].uid: expected a non-empty string"),
    ({"pods": [{"uid": ""}]}, "pods[0].uid: expected a non-empty string"),
    ({"pods": [{"uid": 7}]}, "pods[0].uid: expected a non-empty string"),
    ({"pods": [{"uid": "u", "cause": ["x"]}]}, "pods[0].cause: expected a string"),
    ({"pods": [{"uid": "u" * 254}]}, "pods[0].uid: expected a non-empty string of at most 253"),
])
def test_a_malformed_verdict_is_refused_naming_the_field(document: Any, field: str) -> None:
    with pytest.raises(VerdictError, match=field.replace("[", r"\[").replace("]", r"\]")):
        lostpods.parse_verdict(document)


def test_the_book_keeps_new_verdicts_in_the_file_and_never_one_against_its_own_pod(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lost.json"
    book = VerdictBook(path, own_uid="me")
    assert podloss.read_verdicts(path) == []  # no file yet
    assert book.record([LostPod("me", "job-0", "PodFailed")]) == []
    assert not path.exists()
    first = [LostPod("u1", "job-1", "PodFailed")]
    assert book.record(first) == first
    assert book.record(first) == []  # heard already: the file is not rewritten
    assert book.record([LostPod("u1", "job-1", "PodFailed"), LostPod("u2", "job-2", "")]) == [
        LostPod("u2", "job-2", "")]
    assert podloss.read_verdicts(path) == [LostPod("u1", "job-1", "PodFailed"),
                                           LostPod("u2", "job-2", "")]


def test_the_book_keeps_the_newest_verdicts_only(tmp_path: Path) -> None:
    book = VerdictBook(tmp_path / "lost.json")
    for n in range(lostpods.MAX_PODS + 3):
        book.record([LostPod(f"u{n}", "", "")])
    kept = podloss.read_verdicts(book.path)
    assert len(kept) == lostpods.MAX_PODS
    assert kept[0].uid == "u3" and kept[-1].uid == f"u{lostpods.MAX_PODS + 2}"


# -- which ranks ------------------------------------------------------------------------------


def test_the_registry_maps_initial_ranks_to_pods() -> None:
    text = "".join(podloss.registry_entry(r, uid) for uid, ranks in PODS.items() for r in ranks)
    assert podloss.parse_registry(text + "garbage,=x,7=,") == {
        0: "uid-a", 1: "uid-a", 2: "uid-b", 3: "uid-b", 4: "uid-c", 5: "uid-c"}


REGISTRY = {r: uid for uid, ranks in PODS.items() for r in ranks}


@pytest.mark.parametrize(("lost", "initial_rank_of", "terminated", "expected"), [
    # First loss: ranks are still the initial ones.
    ({"uid-b"}, [0, 1, 2, 3, 4, 5], set(), {2, 3}),
    # Already marked (by the sibling monitor or another survivor): nothing left.
    ({"uid-b"}, [0, 1, 2, 3, 4, 5], {2, 3}, set()),
    ({"uid-b"}, [0, 1, 2, 3, 4, 5], {2}, {3}),
    # After a takeover the spare's processes (initial 4, 5) hold ranks 2 and 3: losing pod C
    # names ranks 2 and 3 of this iteration, losing pod B (gone already) names none.
    ({"uid-c"}, [0, 1, 4, 5], set(), {2, 3}),
    ({"uid-b"}, [0, 1, 4, 5], set(), set()),
    # An unknown pod (not of this launcher cycle) names nothing.
    ({"uid-z"}, [0, 1, 2, 3, 4, 5], set(), set()),
    ({"uid-a", "uid-b"}, [0, 1, 2, 3, 4, 5], set(), {0, 1, 2, 3}),
])
def test_a_verdict_names_exactly_the_current_ranks_of_the_lost_pods_processes(
    lost: set[str], initial_rank_of: list[int], terminated: set[int], expected: set[int],
) -> None:
    assert podloss.ranks_to_terminate(lost, REGISTRY, initial_rank_of, terminated) == expected


# -- marking, against a real store ----------------------------------------------------------


@pytest.fixture
def store() -> Iterator[Any]:
    """The wrapper's store as NVRx's ranks see it (a TCPStore with NVRx's StoreMixin API)."""
    patch_initial_ranks()  # as rtj_trainer.nvrx.inprocess.run does before building the wrapper

    class Store(TCPStore, StoreMixin):  # type: ignore[misc]
        pass

    master = Store(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False,
                   timeout=timedelta(seconds=10))
    yield master


def client(master: Any) -> Any:
    return wrapper_store.client("127.0.0.1", master.port, connect_seconds=10, op_seconds=5)


def enter_iteration(base: Any, iteration: int, initial_rank_of: list[int]) -> Any:
    """What every rank does at the start of an iteration (wrap.py): its initial rank."""
    store = PrefixStore(iteration, base)
    for rank, initial in enumerate(initial_rank_of):
        store.set_initial_rank(rank, initial)
    return store


def register_all(base: Any) -> None:
    for uid, ranks in PODS.items():
        for rank in ranks:
            podloss.register(base, initial_rank=rank, pod_uid=uid)


def arrive(store: Any, ranks: list[int], world_size: int) -> None:
    """Survivors arrive at the iteration barrier (without waiting, like the sibling monitor)."""
    store.iteration_barrier(ranks=ranks, rendezvous_count=world_size, timeout=timedelta(0))


def test_a_verdict_completes_the_iteration_barrier_for_the_lost_ranks(store: Any) -> None:
    base = client(store)
    register_all(base)
    iteration = enter_iteration(base, 0, [0, 1, 2, 3, 4, 5])
    arrive(iteration, [0, 1, 4, 5], 6)  # the survivors and the spare; pod B is gone
    assert not iteration.check([wrapper_store.ITERATION_DONE_KEY])

    outcome = podloss.terminate_lost_ranks(base, iteration=0, world_size=6, initial_world_size=6,
                                           rank=0, lost_uids=["uid-b"])

    assert outcome == (Outcome.MARKED, [2, 3])
    assert iteration.check([wrapper_store.ITERATION_DONE_KEY])  # the barrier is complete
    assert iteration.get_terminated_ranks() == {2, 3}
    records = iteration.get_interruption_records()
    assert {(r.rank, r.interruption) for r in records} == {
        (2, Interruption.UNRESPONSIVE), (3, Interruption.UNRESPONSIVE)}
    assert iteration.check([StoreMixin.ANY_RANK_INTERRUPTED])
    # The termination barrier counts the lost initial ranks (as ints: the NVRx 0.7.0 patch).
    arrived = f"{StoreMixin.BARRIER_PREFIX}:reentrant_barrier:{StoreMixin.TERMINATION_BARRIER}"
    assert base.get(f"{arrived}:arrived").decode() == "2,3,"
    # The iteration is over: the same verdict again (another survivor's) changes nothing.
    assert podloss.terminate_lost_ranks(base, iteration=0, world_size=6, initial_world_size=6,
                                        rank=1, lost_uids=["uid-b"]) == (Outcome.RETRY, [])
    assert iteration.get_terminated_ranks() == {2, 3}


def test_a_verdict_waits_while_a_rank_has_not_entered_the_iteration(store: Any) -> None:
    base = client(store)
    register_all(base)
    enter_iteration(base, 1, [0, 1, 4])  # rank 3 (initial 5) has not begun iteration 1
    assert podloss.terminate_lost_ranks(base, iteration=1, world_size=4, initial_world_size=6,
                                        rank=0, lost_uids=["uid-c"]) == (Outcome.RETRY, [])


def test_a_verdict_on_a_pod_without_ranks_in_the_iteration_is_done(store: Any) -> None:
    base = client(store)
    register_all(base)
    iteration = enter_iteration(base, 1, [0, 1, 4, 5])  # after a takeover of pod B's ranks
    assert podloss.terminate_lost_ranks(base, iteration=1, world_size=4, initial_world_size=6,
                                        rank=0, lost_uids=["uid-b"]) == (Outcome.NOTHING, [])
    assert podloss.terminate_lost_ranks(base, iteration=1, world_size=4, initial_world_size=6,
                                        rank=0, lost_uids=["uid-z"]) == (Outcome.NOTHING, [])
    assert iteration.get_terminated_ranks() == set()
    assert not iteration.check([StoreMixin.ANY_RANK_INTERRUPTED])


def wait_until(what: str, condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_the_listener_registers_its_pod_and_applies_the_shims_verdict(
    store: Any, tmp_path: Path,
) -> None:
    """A worker's thread from start to mark: the survivor of pod A registers once the wrapper
    runs (its first iteration begins), and acts on the file the shim writes."""
    base = client(store)
    for uid, ranks in PODS.items():
        for rank in ranks:
            if rank != 0:
                podloss.register(base, initial_rank=rank, pod_uid=uid)
    iteration = enter_iteration(base, 0, [0, 1, 2, 3, 4, 5])
    arrive(iteration, [0, 1, 4, 5], 6)
    path = tmp_path / "lost.json"
    listener = podloss.PodLossListener(path=path, pod_uid="uid-a", initial_rank=0,
                                       connect=lambda: client(store), poll_seconds=0.05)
    listener.start()
    listener.enter(State(rank=0, world_size=6, active_rank=0, active_world_size=4,
                         mode=Mode.ACTIVE).freeze())
    try:
        wait_until("the listener's registration", lambda: "0=uid-a," in
                   base.get(podloss.REGISTRY_KEY).decode())
        VerdictBook(path, own_uid="uid-a").record([LostPod("uid-b", "job-1", "PodFailed")])
        wait_until("the barrier to complete", lambda: iteration.check(
            [wrapper_store.ITERATION_DONE_KEY]))
        assert iteration.get_terminated_ranks() == {2, 3}
    finally:
        listener.stop()
        listener.join(5)
    assert not listener.is_alive()


def test_a_listener_before_the_wrapper_runs_neither_connects_nor_marks(
    store: Any, tmp_path: Path,
) -> None:
    """Until the wrapper's first iteration begins on this rank (its store may not be up yet)
    the thread waits; afterwards it applies the verdicts already in the file."""
    path = tmp_path / "lost.json"
    VerdictBook(path).record([LostPod("uid-b", "job-1", "PodFailed")])
    connected = threading.Event()

    def connect() -> Any:
        connected.set()
        return client(store)

    listener = podloss.PodLossListener(path=path, pod_uid="uid-c", initial_rank=4,
                                       connect=connect, poll_seconds=0.05)
    listener.start()
    base = client(store)
    for uid, ranks in PODS.items():
        for rank in ranks:
            if rank != 4:
                podloss.register(base, initial_rank=rank, pod_uid=uid)
    iteration = enter_iteration(base, 0, [0, 1, 2, 3, 4, 5])
    arrive(iteration, [0, 1, 4, 5], 6)
    assert not connected.is_set()  # nothing to wait on before `enter`: the thread blocks on it
    try:
        listener.enter(State(rank=4, world_size=6, mode=Mode.INACTIVE).freeze())
        wait_until("the barrier to complete", lambda: iteration.check(
            [wrapper_store.ITERATION_DONE_KEY]))
        assert iteration.get_terminated_ranks() == {2, 3}
        assert podloss.parse_registry(base.get(podloss.REGISTRY_KEY).decode())[4] == "uid-c"
    finally:
        listener.stop()
        listener.join(5)


# -- the shim's endpoint ----------------------------------------------------------------------


def post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}") if error.code == 400 else {}


def test_the_pod_endpoint_takes_verdicts_into_the_book(tmp_path: Path) -> None:
    book = VerdictBook(tmp_path / "lost.json", own_uid="me")
    ranks = podmetrics.PodRanks(host="127.0.0.1", metrics_port=1, procs=1,
                                fetch=lambda url: None)
    server = podmetrics.serve(ranks, "127.0.0.1", 0, book)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.shutdown)
    try:
        good = json.dumps({"pods": [{"uid": "u1", "name": "job-1", "cause": "PodFailed"}]})
        assert post(url + "/lost-pods", good.encode()) == (200, {"accepted": 1})
        assert post(url + "/lost-pods", good.encode()) == (200, {"accepted": 0})
        status, answer = post(url + "/lost-pods", b'{"pods": [{"name": "x"}]}')
        assert status == 400 and "pods[0].uid" in answer["error"]
        status, answer = post(url + "/lost-pods", b"not json")
        assert status == 400
        assert post(url + "/ranks", good.encode())[0] == 404
        assert podloss.read_verdicts(book.path) == [LostPod("u1", "job-1", "PodFailed")]
    finally:
        thread.start()
        thread.join(5)
        server.server_close()


def test_without_a_book_the_endpoint_takes_no_verdicts(tmp_path: Path) -> None:
    ranks = podmetrics.PodRanks(host="127.0.0.1", metrics_port=1, procs=1,
                                fetch=lambda url: None)
    server = podmetrics.serve(ranks, "127.0.0.1", 0)
    try:
        status, _ = post(f"http://127.0.0.1:{server.server_address[1]}/lost-pods",
                         b'{"pods": [{"uid": "u1"}]}')
        assert status == 404
    finally:
        threading.Thread(target=server.shutdown).start()
        server.server_close()
