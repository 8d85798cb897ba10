"""Pure logic of the process-backed nodes: env like kubelet, hosts files, pod IPs, node objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness.envvars import (
    EnvResolutionError,
    expand,
    expand_command,
    field_ref_value,
    resolve_container_env,
)
from harness.ipam import LoopbackIpAllocator
from harness.kubelet.hostsfile import RunningPod, ServiceEntry, render_hosts
from harness.nodestate import (
    exit_code_of,
    node_manifest,
    node_status,
    pod_conditions,
    refusal_waiting,
)

pytestmark = pytest.mark.unit

POD = {
    "metadata": {"name": "job-0", "namespace": "team", "uid": "u-1", "labels": {"role": "trainer"}},
    "spec": {"nodeName": "p5-node-1"},
}
CONFIG_MAPS = {"settings": {"lr": "0.1", "steps": "10"}}
SECRETS = {"creds": {"token": "s3cret"}}


def lookup_in(store: dict[str, dict[str, str]]):  # type: ignore[no-untyped-def]
    def lookup(name: str, key: str) -> str | None:
        if name not in store:
            return None
        return json.dumps(store[name]) if key == "" else store[name].get(key)

    return lookup


def resolve(container: dict[str, object]) -> dict[str, str]:
    return resolve_container_env(
        POD,
        container,
        pod_ip="127.9.0.3",
        host_ip="127.9.255.2",
        config_map_key=lookup_in(CONFIG_MAPS),
        secret_key=lookup_in(SECRETS),
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)-$(B)", "1-two"),
        ("$$(A)", "$(A)"),
        ("$(MISSING)", "$(MISSING)"),
        ("tail $(A", "tail $(A"),
        ("$x and $", "$x and $"),
        ("$(A)$(A)", "11"),
        ("no refs", "no refs"),
    ],
)
def test_expand_follows_kubelet_rules(text: str, expected: str) -> None:
    assert expand(text, {"A": "1", "B": "two"}) == expected


def test_env_values_see_only_variables_defined_before_them() -> None:
    env = resolve(
        {
            "env": [
                {"name": "FIRST", "value": "a-$(SECOND)"},
                {"name": "SECOND", "value": "b"},
                {"name": "THIRD", "value": "$(FIRST)+$(SECOND)"},
            ]
        }
    )
    assert env == {"FIRST": "a-$(SECOND)", "SECOND": "b", "THIRD": "a-$(SECOND)+b"}


def test_value_from_resolves_downward_api_config_maps_and_secrets() -> None:
    def field(path: str) -> dict[str, object]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = resolve(
        {
            "env": [
                {"name": "POD_NAME", **field("metadata.name")},
                {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                {"name": "POD_UID", **field("metadata.uid")},
                {"name": "ROLE", **field("metadata.labels['role']")},
                {"name": "POD_IP", **field("status.podIP")},
                {"name": "NODE", **field("spec.nodeName")},
                {"name": "LR", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "lr"}}},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                {"name": "ADDR", "value": "$(POD_IP):29400"},
            ]
        }
    )
    assert env == {
        "POD_NAME": "job-0",
        "POD_NAMESPACE": "team",
        "POD_UID": "u-1",
        "ROLE": "trainer",
        "POD_IP": "127.9.0.3",
        "NODE": "p5-node-1",
        "LR": "0.1",
        "TOKEN": "s3cret",
        "ADDR": "127.9.0.3:29400",
    }


def test_a_missing_key_fails_unless_optional() -> None:
    missing = {"name": "X", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "nope"}}}
    with pytest.raises(EnvResolutionError):
        resolve({"env": [missing]})
    missing["valueFrom"]["configMapKeyRef"]["optional"] = True  # type: ignore[index]
    assert resolve({"env": [missing]}) == {}


def test_env_from_applies_first_with_prefix_and_env_overrides_it() -> None:
    env = resolve(
        {
            "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CFG_"}],
            "env": [{"name": "CFG_lr", "value": "0.5"}],
        }
    )
    assert env == {"CFG_lr": "0.5", "CFG_steps": "10"}


def test_unknown_field_paths_are_rejected() -> None:
    with pytest.raises(EnvResolutionError):
        field_ref_value(POD, "spec.unknown", "127.9.0.3", "127.9.255.2")


def test_command_and_args_are_expanded_from_the_container_env() -> None:
    argv = expand_command(["sh", "-c"], ["echo $(NAME) $$(NAME) $(OTHER)"], {"NAME": "x"})
    assert argv == ["sh", "-c", "echo x $(NAME) $(OTHER)"]


def test_hosts_file_maps_pod_and_service_names_like_cluster_dns() -> None:
    pods = [
        RunningPod("team", "job-0", "127.9.0.1", "job-0", "job", {"app": "job", "i": "0"}),
        RunningPod("team", "job-1", "127.9.0.2", "job-1", "job", {"app": "job", "i": "1"}),
        RunningPod("team", "rdzv", "127.9.0.3", None, None, {"app": "rdzv"}),
        RunningPod("other", "x", "127.9.0.4", "x", "job", {"app": "rdzv"}),
    ]
    services = [
        ServiceEntry("team", "job", None),
        ServiceEntry("team", "job-rdzv", {"app": "rdzv"}),
        ServiceEntry("team", "no-selector", None),
    ]
    text = render_hosts(
        namespace="team",
        pod_ip="127.9.0.1",
        hostname="job-0",
        subdomain="job",
        pods=pods,
        services=services,
    )
    lines = text.splitlines()
    assert "127.0.0.1\tlocalhost" in lines
    assert "127.9.0.1\tjob-0.job.team.svc.cluster.local job-0" in lines
    assert (
        "127.9.0.2\tjob-1.job.team.svc.cluster.local job-1.job.team.svc job-1.job.team job-1.job"
        in lines
    )
    assert (
        "127.9.0.3\tjob-rdzv.team.svc.cluster.local job-rdzv.team.svc job-rdzv.team job-rdzv"
        in lines
    )
    assert not any(line.startswith("127.9.0.4") for line in lines), "no Service 'job' in 'other'"
    assert "no-selector" not in text


def test_hosts_file_gives_short_names_only_within_the_own_namespace() -> None:
    text = render_hosts(
        namespace="elsewhere",
        pod_ip="127.9.0.9",
        hostname="client",
        subdomain=None,
        pods=[RunningPod("team", "rdzv", "127.9.0.3", None, None, {"app": "rdzv"})],
        services=[ServiceEntry("team", "job-rdzv", {"app": "rdzv"})],
    )
    assert "127.9.0.9\tclient\n" in text
    assert "127.9.0.3\tjob-rdzv.team.svc.cluster.local job-rdzv.team.svc job-rdzv.team\n" in text


def test_pod_ips_are_unique_loopback_addresses_and_never_127_0_0_1() -> None:
    allocator = LoopbackIpAllocator(second_octet=7)
    addresses = [allocator.allocate() for _ in range(600)]
    assert len(set(addresses)) == 600
    assert all(a.startswith("127.7.") and not a.endswith(".0") for a in addresses)
    assert "127.0.0.1" not in addresses
    assert addresses[:2] == ["127.7.0.1", "127.7.0.2"]
    assert addresses[254] == "127.7.1.1"
    assert allocator.node_ip(0) == "127.7.255.1"


def test_released_pod_ips_are_reused_only_after_the_range_wraps() -> None:
    allocator = LoopbackIpAllocator(second_octet=7)
    first = allocator.allocate()
    allocator.release(first)
    assert allocator.allocate() != first
    allocator = LoopbackIpAllocator(second_octet=7)
    allocator._SLOTS = 3  # a tiny range to see the wrap-around
    taken = [allocator.allocate() for _ in range(3)]
    allocator.release(taken[1])
    assert allocator.allocate() == taken[1]
    with pytest.raises(RuntimeError):
        allocator.allocate()


def test_nodes_are_shaped_like_p5_48xlarge() -> None:
    manifest = node_manifest("p5-node-0", 0)
    labels = manifest["metadata"]["labels"]
    assert labels["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert labels["kubernetes.io/hostname"] == "p5-node-0"
    status = node_status("p5-node-0", "127.7.255.1", ready=True, transition="t")
    assert status["allocatable"] == status["capacity"]
    assert status["allocatable"]["nvidia.com/gpu"] == "8"
    assert status["allocatable"]["vpc.amazonaws.com/efa"] == "32"
    assert status["allocatable"]["cpu"] == "192"
    ready = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "True"
    not_ready = node_status("p5-node-0", "127.7.255.1", ready=False, transition="t")
    assert [c["status"] for c in not_ready["conditions"] if c["type"] == "Ready"] == ["False"]


def test_a_signal_death_reports_128_plus_the_signal_like_kubelet() -> None:
    assert exit_code_of(-9) == 137
    assert exit_code_of(-15) == 143
    assert exit_code_of(7) == 7
    assert exit_code_of(0) == 0


def test_pod_conditions_keep_the_schedulers_pod_scheduled_condition() -> None:
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "then"}
    pod = {"status": {"conditions": [scheduled]}}
    conditions = pod_conditions(pod, None, ready=False)
    assert scheduled in conditions
    assert {c["type"] for c in conditions} == {
        "PodReadyToStartContainers",
        "Initialized",
        "ContainersReady",
        "Ready",
        "PodScheduled",
    }


def test_pod_conditions_keep_a_condition_another_component_set() -> None:
    """The eviction API sets DisruptionTarget before it deletes the pod; a kubelet posting the
    pod's status at exit keeps it (its status manager merges only its own conditions)."""
    evicted = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
               "message": "Eviction API: evicting", "lastTransitionTime": "then"}
    stale_ready = {"type": "Ready", "status": "True", "lastTransitionTime": "then"}
    pod = {"status": {"conditions": [evicted, stale_ready]}}
    conditions = pod_conditions(pod, None, ready=False)
    assert evicted in conditions
    assert [c["status"] for c in conditions if c["type"] == "Ready"] == ["False"]
    assert len(conditions) == 6


def test_a_checkout_and_run_dir_under_tmp_stay_visible_through_the_private_tmp() -> None:
    from harness.kubelet.runtime import REPO_ROOT, paths_to_keep_visible

    work = Path("/tmp/pytest-of-root/p1/cluster0/pod-data/ns_pod/work")
    kept = paths_to_keep_visible(work, f"/tmp/bin-a:{work}:/usr/bin")
    assert work in kept
    assert Path("/usr/bin") not in kept
    if Path("/tmp") in REPO_ROOT.resolve().parents:  # a CI clone under /tmp
        assert REPO_ROOT.resolve() in kept
    # nested paths are covered by their parent's bind mount: no duplicate mounts
    assert len(kept) == len(set(kept))
    assert not any(a != b and a in b.parents for a in kept for b in kept)


def test_a_refused_image_pull_alternates_like_kubelets_image_back_off() -> None:
    image, message = "registry.local/app:1", "not found"
    seen = []
    pulls = None
    for now in (100.0, 101.0, 102.5, 109.9, 110.0, 112.5, 130.0):
        waiting, pulls = refusal_waiting("ErrImagePull", message, image, pulls, now)
        seen.append((now, waiting.reason))
    assert seen == [
        (100.0, "ErrImagePull"),  # the first pull fails
        (101.0, "ErrImagePull"),  # still shown until the next sync
        (102.5, "ImagePullBackOff"),  # backing off 10 s
        (109.9, "ImagePullBackOff"),
        (110.0, "ErrImagePull"),  # the second pull fails: 20 s back-off
        (112.5, "ImagePullBackOff"),
        (130.0, "ErrImagePull"),
    ]
    backoff, _ = refusal_waiting("ErrImagePull", message, image, (200.0, 3), 170.0)
    assert backoff.message == f'Back-off pulling image "{image}": ErrImagePull: not found'


def test_other_refusal_reasons_are_reported_as_they_are() -> None:
    waiting, pulls = refusal_waiting(
        "CreateContainerConfigError", 'secret "creds" not found', "x", None, 5.0
    )
    assert (waiting.reason, waiting.message, pulls) == (
        "CreateContainerConfigError",
        'secret "creds" not found',
        None,
    )


def test_the_node_monitor_grace_period_allows_several_missed_lease_renewals() -> None:
    from harness.controlplane import NODE_MONITOR_GRACE_SECONDS, NODE_MONITOR_PERIOD_SECONDS
    from harness.kubelet.nodes import LEASE_RENEW_SECONDS

    # A real cluster allows 5 (50 s grace, renewal every 10 s); fewer would flap busy nodes.
    assert NODE_MONITOR_GRACE_SECONDS >= 5 * LEASE_RENEW_SECONDS
    assert NODE_MONITOR_PERIOD_SECONDS < NODE_MONITOR_GRACE_SECONDS


def test_two_allocators_alive_at_once_never_share_a_range() -> None:
    # Each claims its /16 for as long as it lives (a socket bound on 127.<a>.255.255), and skips
    # one another allocator holds, here in the same process as in two.
    allocators = [LoopbackIpAllocator() for _ in range(40)]
    try:
        octets = [a.second_octet for a in allocators]
        assert len(set(octets)) == 40 and all(2 <= o <= 254 for o in octets)
    finally:
        for allocator in allocators:
            allocator.close()
    from harness.ipam import _claim

    again = _claim(octets[0])  # a range given back can be claimed again
    assert again is not None
    again.close()
