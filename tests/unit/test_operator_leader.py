"""The leader-election rule (`rtj_operator.leader.may_acquire`), table-tested without a clock."""

from __future__ import annotations

import pytest
from rtj_operator.leader import Seen, may_acquire

pytestmark = pytest.mark.unit


def seen(holder: str, at: float = 100.0, duration: float = 15.0) -> Seen:
    return Seen(holder=holder, resource_version="1", lease_duration_seconds=duration, seen_at=at)


@pytest.mark.parametrize(
    ("record", "now", "allowed", "why"),
    [
        (None, 0.0, True, "no Lease yet: create it"),
        (seen(""), 100.0, True, "released: no holder"),
        (seen("me"), 100.0, True, "ours: renew"),
        (seen("other"), 100.0, False, "just seen changing"),
        (seen("other"), 114.9, False, "changed less than a lease duration ago"),
        (seen("other"), 115.0, True, "unchanged for a lease duration: the holder is gone"),
        (seen("other", duration=1.0), 101.0, True, "the holder's own (short) duration counts"),
    ],
)
def test_may_acquire(record: Seen | None, now: float, allowed: bool, why: str) -> None:
    assert may_acquire(record, "me", now) is allowed, why


def test_a_connection_that_hangs_gives_up_at_the_connect_limit_not_the_calls() -> None:
    """An API server address that drops packets (here a listener whose accept queue is full:
    the kernel drops the SYNs) held one call for the client's whole `_request_timeout` at each
    of urllib3's three connection retries: 4 x 30 s for the operator's default. The operator's
    client gives each connection attempt `api_connect_timeout_seconds` and the call fails with
    a connect timeout, which the pass treats like any failed call."""
    import socket
    import threading

    import kubernetes.client
    import urllib3
    from rtj_operator.leader import limit_connects

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    host, port = server.getsockname()
    filler = socket.create_connection((host, port))  # the accept queue is full from here on
    configuration = kubernetes.client.Configuration()
    configuration.host = f"http://{host}:{port}"
    core = kubernetes.client.CoreV1Api(
        limit_connects(kubernetes.client.ApiClient(configuration), connect_seconds=0.2))
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            core.list_namespaced_pod("ns", _request_timeout=120)
        except BaseException as error:
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=20)  # 4 x 0.2 s with the limit; 4 x 120 s without it
    try:
        assert not caller.is_alive(), "still connecting: the call's own 120 s limit applied"
        assert len(outcome) == 1 and isinstance(outcome[0], urllib3.exceptions.MaxRetryError)
        assert isinstance(outcome[0].reason, urllib3.exceptions.ConnectTimeoutError)
    finally:
        filler.close()
        server.close()
