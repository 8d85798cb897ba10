"""Leader election (`rtj_operator.leader.LeaseElector`) against the real API server's Leases.

The candidates' clocks are fake (a number the test moves), so takeover after a lease duration and
losing the lead after the renew deadline are checked without waiting."""

from __future__ import annotations

import pytest
from harness.cluster import Cluster
from rtj_operator.config import OperatorSettings
from rtj_operator.leader import LeaseElector

pytestmark = pytest.mark.integration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_leader_a_follower_takes_over_only_after_a_lease_duration(
    cluster: Cluster, namespace: str,
) -> None:
    settings = OperatorSettings(leader_election=True, leader_election_namespace=namespace,
                                leader_election_lease_name="ops", lease_duration_seconds=15,
                                lease_renew_deadline_seconds=10, lease_retry_period_seconds=2)
    clock_a, clock_b = Clock(), Clock()
    a = LeaseElector(cluster.api_client(), settings, identity="a", clock=clock_a)
    b = LeaseElector(cluster.api_client(), settings, identity="b", clock=clock_b)
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/ops"

    assert a.try_acquire_or_renew() and a.is_leader()
    assert not b.try_acquire_or_renew() and not b.is_leader()
    lease = cluster.api.get(path)["spec"]
    assert lease["holderIdentity"] == "a" and lease["leaseDurationSeconds"] == 15

    # a renews: b sees the record change, so its wait starts again.
    clock_b.now += 14
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    clock_b.now += 14
    assert not b.try_acquire_or_renew()  # 14 s since it last saw a change
    # a stops renewing (killed): a lease duration later, by b's clock, b takes over.
    clock_b.now += 1
    assert b.try_acquire_or_renew() and b.is_leader()
    lease = cluster.api.get(path)["spec"]
    assert lease["holderIdentity"] == "b" and lease["leaseTransitions"] == 1

    # a, back after a pause past its renew deadline, neither leads nor takes the Lease back.
    clock_a.now += 10
    assert not a.is_leader()
    assert not a.try_acquire_or_renew()
    assert cluster.api.get(path)["spec"]["holderIdentity"] == "b"

    # b hands the Lease back on shutdown: a takes it at once.
    b.release()
    assert not b.is_leader()
    assert "holderIdentity" not in cluster.api.get(path)["spec"]
    assert a.try_acquire_or_renew() and a.is_leader()
