"""The operator's settings from the environment (`rtj_operator.config`)."""

from __future__ import annotations

import pytest
from rtj_operator.config import (
    ConfigurationError,
    OperatorSettings,
    load_settings,
    pinned_to_services,
)

pytestmark = pytest.mark.unit


def test_settings_default_when_nothing_is_set() -> None:
    assert load_settings({}) == OperatorSettings()


def test_settings_are_read_from_prefixed_variables() -> None:
    settings = load_settings({
        "RTJ_OPERATOR_NAMESPACE": "ml",
        "RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS": "2.5",
        "RTJ_OPERATOR_METRICS_PORT": "0",
        "RTJ_OPERATOR_LEADER_ELECTION": "true",
        "RTJ_OPERATOR_LEADER_ELECTION_NAMESPACE": "ops",
        "UNRELATED": "x",
    })
    assert settings.namespace == "ml"
    assert settings.reconcile_interval_seconds == 2.5
    assert settings.metrics_port == 0
    assert settings.leader_election is True
    assert settings.leader_election_namespace == "ops"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS", "fast", "expected a number"),
        ("RTJ_OPERATOR_METRICS_PORT", "80.5", "expected an integer"),
        ("RTJ_OPERATOR_LEADER_ELECTION", "maybe", "expected true or false"),
        ("RTJ_OPERATOR_LEADER_ELECTION", "true", "needs RTJ_OPERATOR_LEADER_ELECTION_NAMESPACE"),
        ("RTJ_OPERATOR_LEASE_RENEW_DEADLINE_SECONDS", "20", "retry period < renew deadline"),
        ("RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS", "0", "must be > 0"),
        ("RTJ_OPERATOR_RENDEZVOUS_PORT", "70000", "not a usable port"),
        ("RTJ_OPERATOR_RECONCILE_INTERVALL_SECONDS", "3", "unknown setting"),
        ("RTJ_OPERATOR_NETWORK_POLICY_OPERATOR_LABELS", "app=rtj,oops", "expected key=value"),
        ("RTJ_OPERATOR_NETWORK_POLICY", "maybe", "expected true or false"),
    ],
)
def test_a_bad_setting_is_an_error_that_names_the_variable(
    variable: str, value: str, expected: str
) -> None:
    with pytest.raises(ConfigurationError) as error:
        load_settings({variable: value})
    assert variable in str(error.value)
    assert expected in str(error.value)


def test_an_operator_in_a_pod_that_writes_network_policies_must_name_its_namespace() -> None:
    # review-2 F7: in a pod, with policies on and no operator namespace, no job's policy would
    # admit the operator; on an enforcing CNI it could read no trainer pod.
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    with pytest.raises(ConfigurationError) as error:
        load_settings(in_pod)
    assert "RTJ_OPERATOR_NETWORK_POLICY_OPERATOR_NAMESPACE" in str(error.value)
    assert load_settings({**in_pod, "RTJ_OPERATOR_NETWORK_POLICY_OPERATOR_NAMESPACE": "rtj"})
    assert not load_settings({**in_pod, "RTJ_OPERATOR_NETWORK_POLICY": "false"}).network_policy
    assert load_settings({}).network_policy  # outside a pod (a developer's, the harness's)


def test_liveness_endpoint_is_off_with_port_zero() -> None:
    assert OperatorSettings(liveness_port=0).liveness_endpoint() is None
    assert OperatorSettings().liveness_endpoint() == "http://127.0.0.1:8091/healthz"


def test_the_operator_exits_with_a_clear_error_on_bad_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rtj_operator import __main__ as entry
    from rtj_operator.config import settings_from_environment

    monkeypatch.setenv("RTJ_OPERATOR_METRICS_PORT", "eighty")
    settings_from_environment.cache_clear()
    try:
        assert entry.main() == 2
    finally:
        settings_from_environment.cache_clear()
    assert "RTJ_OPERATOR_METRICS_PORT='eighty': expected an integer" in capsys.readouterr().err


def test_api_calls_are_bounded_and_a_stuck_pass_fails_liveness() -> None:
    from rtj_operator.handlers import stuck_passes

    settings = load_settings({"RTJ_OPERATOR_API_REQUEST_TIMEOUT_SECONDS": "12",
                              "RTJ_OPERATOR_STUCK_PASS_SECONDS": "60"})
    assert (settings.api_request_timeout_seconds, settings.stuck_pass_seconds) == (12.0, 60.0)
    in_flight = {"ns/a": 100.0, "ns/b": 150.0}
    assert stuck_passes(in_flight, now=170.0, limit=60.0) == ["ns/a"]
    assert stuck_passes(in_flight, now=159.0, limit=60.0) == []


def test_a_job_keeps_the_ports_of_its_services_when_the_settings_change() -> None:
    restarted = OperatorSettings(rendezvous_port=30000, trainer_metrics_port=9500)
    pinned = pinned_to_services(restarted, {"rendezvous": 29400, "metrics": 9400})
    assert (pinned.rendezvous_port, pinned.trainer_metrics_port) == (29400, 9400)
    assert pinned.reconcile_interval_seconds == restarted.reconcile_interval_seconds
    # A new job (no Services yet) gets the settings' ports; equal ports change nothing.
    assert pinned_to_services(restarted, {}) is restarted
    assert pinned_to_services(restarted, {"rendezvous": 30000}) is restarted
