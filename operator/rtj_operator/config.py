"""Operator settings, read from the environment once at start-up into one typed object.

Every setting is a field of `OperatorSettings` with a default, its unit in its name and a
docstring. The environment variable of a field is `RTJ_OPERATOR_<FIELD NAME IN UPPER CASE>`
(`reconcile_interval_seconds` -> `RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS`). Parsing is written
once, generically, from the field types; a bad value fails start-up with an error that names the
variable, the value and what was expected.

These are settings of the *operator process* (where it listens, how often it reconciles). What a
training job needs is in the job's spec, not here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass

ENV_PREFIX = "RTJ_OPERATOR_"


class ConfigurationError(ValueError):
    """An environment variable of the operator has a value it cannot use."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OperatorSettings:
    """All settings of the operator process."""

    namespace: str = ""
    """Namespace to watch; empty means every namespace (cluster-wide)."""

    reconcile_interval_seconds: float = 3.0
    """How often each job is reconciled (level-based), in seconds."""

    scrape_timeout_seconds: float = 2.0
    """Time limit of one HTTP GET of a trainer pod's liveness endpoint (or, for a trainer image
    without it, of one rank's /metrics), in seconds; waiting for a free slot does not count."""

    scrape_concurrency: int = 64
    """Most liveness requests in flight at once, across every job (one shared HTTP client)."""

    sweep_reads_per_second: float = 500.0
    """The background reads of every pod of every job (each job's sweep, every reconcile
    interval) are spread so that they come to at most this many pod reads a second in all: a job
    sweeps every `reconcile_interval_seconds`, or less often while the operator watches more
    than this x that interval pods (5,000 pods: every 10 s). Hang detection does not wait for a
    sweep: each pod is read again just after its own heartbeat deadline."""

    status_progress_interval_seconds: float = 10.0
    """A status change that is only progress (heartbeat times, steps, goodput, the newest
    checkpoint) is written at most this often per job; anything else (state, conditions,
    incidents, a rank's state) is written at once."""

    api_request_timeout_seconds: float = 30.0
    """Time limit of one Kubernetes API call: a half-open connection must not hold a job's pass
    (and its lock) for ever."""

    api_connect_timeout_seconds: float = 5.0
    """Time limit of one attempt to connect to the Kubernetes API (within the request's own
    limit): an address that drops packets must not hold a pass for the request's whole limit
    at each of the client's connection retries."""

    stuck_pass_seconds: float = 300.0
    """The liveness probe fails once a reconcile pass has run this long (it is stuck), so the
    kubelet restarts the operator."""

    trainer_metrics_port: int = 9400
    """Base port of the trainers' metrics (`RTJ_METRICS_PORT`); local rank r serves on base + r."""

    rendezvous_port: int = 29400
    """Port of the job's rendezvous store (nvrx-control) and its Service."""

    rendezvous_join_timeout_seconds: int = 600
    """How long launchers wait in a rendezvous round for every node (`join_timeout`). It must
    cover the time to create and start a replacement pod."""

    metrics_host: str = "127.0.0.1"
    """Address the operator's own Prometheus metrics server binds (the chart sets 0.0.0.0)."""

    metrics_port: int = 8090
    """Port of the operator's own Prometheus metrics; 0 turns the server off."""

    liveness_host: str = "127.0.0.1"
    """Address of the liveness endpoint (the chart sets 0.0.0.0)."""

    liveness_port: int = 8091
    """Port of the liveness endpoint (`GET /healthz`); 0 turns it off."""

    leader_election: bool = False
    """Act only while holding a coordination.k8s.io Lease (`rtj_operator.leader`): for several
    replicas, of which one (the leader) runs kopf and the others wait to take over."""

    leader_election_namespace: str = ""
    """Namespace of the Lease; required with leader election (the chart: its own namespace)."""

    leader_election_lease_name: str = "rtj-operator"
    """Name of the Lease; replicas that share it elect one leader."""

    lease_duration_seconds: float = 15.0
    """A follower takes the Lease once its holder has not renewed it for this long."""

    lease_renew_deadline_seconds: float = 10.0
    """The leader exits (and stops acting) when it could not renew the Lease for this long; it
    must be shorter than the lease duration, so that it has stopped before anyone takes over."""

    lease_retry_period_seconds: float = 2.0
    """How often the leader renews, and a follower tries to acquire, the Lease."""

    network_policy: bool = True
    """Create a NetworkPolicy per job that admits ingress to its pods only from the job's own
    pods and from the operator (docs/security.md); enforced only by a CNI that implements
    NetworkPolicy."""

    network_policy_operator_namespace: str = ""
    """Namespace of the operator's pods, admitted to the trainers' metrics ports by each job's
    NetworkPolicy (the chart sets the release namespace). Empty: no operator rule (an operator
    outside the cluster, as in the test harness, is not a pod a policy can select)."""

    network_policy_operator_labels: str = ""
    """Labels of the operator's pods as `k=v,k=v` (the chart sets its selector labels); with
    `network_policy_operator_namespace`, they select the operator in each job's policy."""

    network_policy_scraper_namespace: str = ""
    """Namespace of a Prometheus that scrapes the trainers, admitted by each job's NetworkPolicy
    to the trainers' metrics ports (`TRAINER_METRICS_PORT` .. `+ procsPerNode - 1`; not the pod's
    liveness endpoint). Empty: no such rule (the chart sets it from
    `metrics.trainers.prometheus.namespace`)."""

    network_policy_scraper_labels: str = ""
    """Labels of that Prometheus's pods as `k=v,k=v`; empty: every pod of its namespace."""

    def liveness_endpoint(self) -> str | None:
        """The URL kopf serves its liveness probe on, or None when it is off."""
        if self.liveness_port == 0:
            return None
        return f"http://{self.liveness_host}:{self.liveness_port}/healthz"


def label_map(text: str) -> dict[str, str]:
    """`k=v,k=v` (a setting) as a dict; raises ConfigurationError on an entry without `=`."""
    labels: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        key, sep, value = entry.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"{entry!r}: expected key=value")
        labels[key.strip()] = value.strip()
    return labels


def env_name(field_name: str) -> str:
    """The environment variable that sets a field."""
    return ENV_PREFIX + field_name.upper()


def _coerce(raw: str, kind: type, variable: str) -> object:
    """Turn the text of an environment variable into a value of a field's type."""
    text = raw.strip()
    if kind is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigurationError(f"{variable}={raw!r}: expected true or false")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigurationError(f"{variable}={raw!r}: expected an integer") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigurationError(f"{variable}={raw!r}: expected a number") from None
    return raw


def _check_ranges(settings: OperatorSettings) -> None:
    """Reject values of the right type that still make no sense."""
    positive = ("reconcile_interval_seconds", "scrape_timeout_seconds", "scrape_concurrency",
                "sweep_reads_per_second",
                "rendezvous_join_timeout_seconds", "api_request_timeout_seconds",
                "api_connect_timeout_seconds",
                "stuck_pass_seconds", "lease_duration_seconds", "lease_renew_deadline_seconds",
                "lease_retry_period_seconds")
    for name in positive:
        if getattr(settings, name) <= 0:
            raise ConfigurationError(f"{env_name(name)}={getattr(settings, name)}: must be > 0")
    if not (settings.lease_retry_period_seconds < settings.lease_renew_deadline_seconds
            < settings.lease_duration_seconds):
        raise ConfigurationError(
            f"{env_name('lease_retry_period_seconds')}={settings.lease_retry_period_seconds:g}, "
            f"{env_name('lease_renew_deadline_seconds')}={settings.lease_renew_deadline_seconds:g}"
            f", {env_name('lease_duration_seconds')}={settings.lease_duration_seconds:g}: "
            "must be retry period < renew deadline < lease duration")
    if settings.leader_election and not settings.leader_election_namespace:
        raise ConfigurationError(
            f"{env_name('leader_election')}=true needs {env_name('leader_election_namespace')}")
    for name in ("trainer_metrics_port", "rendezvous_port", "metrics_port", "liveness_port"):
        port = getattr(settings, name)
        if not 0 <= port <= 65535 or (port == 0 and name in ("trainer_metrics_port",
                                                               "rendezvous_port")):
            raise ConfigurationError(f"{env_name(name)}={port}: not a usable port")
    for name in ("network_policy_operator_labels", "network_policy_scraper_labels"):
        try:
            label_map(getattr(settings, name))
        except ConfigurationError as error:
            raise ConfigurationError(f"{env_name(name)}: {error}") from None


def load_settings(environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """Settings from `environ` (default: the process environment); unset variables keep defaults.

    Raises ConfigurationError naming the variable when a value cannot be used, and also for
    unknown `RTJ_OPERATOR_*` variables (a typo must not silently keep a default).
    """
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(OperatorSettings)
    known = {env_name(f.name): f.name for f in dataclasses.fields(OperatorSettings)}
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        raise ConfigurationError(
            f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    values = {
        field_name: _coerce(env[variable], hints[field_name], variable)
        for variable, field_name in known.items()
        if variable in env
    }
    settings = OperatorSettings(**values)  # type: ignore[arg-type]
    _check_ranges(settings)
    _check_in_pod(settings, env)
    return settings


def _check_in_pod(settings: OperatorSettings, env: Mapping[str, str]) -> None:
    """An operator that runs in a pod (the kubelet set `KUBERNETES_SERVICE_HOST`) and writes
    NetworkPolicies must name its own namespace: without it no job's policy admits the
    operator, and on an enforcing CNI it could read no trainer pod (review-2 F7). Outside a
    pod (a developer's operator, the test harness) it is not a pod a policy could select."""
    if (settings.network_policy and not settings.network_policy_operator_namespace
            and env.get("KUBERNETES_SERVICE_HOST")):
        raise ConfigurationError(
            f"{env_name('network_policy')}=true in a pod needs "
            f"{env_name('network_policy_operator_namespace')} (the operator's namespace; the "
            f"chart sets it), or {env_name('network_policy')}=false")


@functools.cache
def settings_from_environment() -> OperatorSettings:
    """The process's settings, parsed once (the handlers need the interval at import time)."""
    return load_settings()


def pinned_to_services(settings: OperatorSettings, service_ports: Mapping[str, int]
                       ) -> OperatorSettings:
    """`settings` with the job's ports taken from its existing Services (`rendezvous`, `metrics`
    by port name). A job keeps the ports it was created with: when the operator restarts with
    another `RTJ_OPERATOR_RENDEZVOUS_PORT` or `..._TRAINER_METRICS_PORT`, a replacement pod must
    still join the rendezvous pod that runs on the old port, and the scraper must still read the
    old pods. A job without Services yet gets the settings' ports."""
    rendezvous = service_ports.get("rendezvous", settings.rendezvous_port)
    metrics = service_ports.get("metrics", settings.trainer_metrics_port)
    if (rendezvous, metrics) == (settings.rendezvous_port, settings.trainer_metrics_port):
        return settings
    return dataclasses.replace(settings, rendezvous_port=rendezvous,
                               trainer_metrics_port=metrics)
