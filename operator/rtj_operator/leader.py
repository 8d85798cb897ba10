"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it.

With `RTJ_OPERATOR_LEADER_ELECTION=true` every replica first waits to hold the Lease; only the
holder starts kopf (watches, handlers, timers), so a follower never acts on a job. The leader
renews the Lease every retry period from a thread of its own; when it has not managed to renew it
for the renew deadline it exits at once (exit code 1, the kubelet restarts it as a follower):
the renew deadline is shorter than the lease duration, so it has stopped before a follower may
take over. A follower takes the Lease when the holder has not changed it for a lease duration,
timed by the follower's own monotonic clock from when it last saw the record change (never by
comparing the holder's timestamps with its own clock), and every write carries the
resourceVersion it read, so two followers cannot both win. A leader that stops on SIGTERM hands
the Lease back (no holder), so a rollout does not wait for the lease duration.

`may_acquire` is the rule, pure; `LeaseElector` does the API calls and keeps the clock.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3
from kubernetes.client.exceptions import ApiException

from rtj_operator import metrics
from rtj_operator.config import OperatorSettings

LOG = logging.getLogger("rtj_operator.leader")


def load_config() -> None:
    """The kubernetes client's default configuration: in-cluster (a pod's ServiceAccount token
    and KUBERNETES_SERVICE_HOST/PORT) when there is one, else the kubeconfig."""
    load_incluster: Any = kubernetes.config.load_incluster_config  # untyped in the stubs
    load_kubeconfig: Any = kubernetes.config.load_kube_config
    try:
        load_incluster()
    except kubernetes.config.ConfigException:
        load_kubeconfig()


def limit_connects(api: Any, connect_seconds: float) -> Any:
    """`api` (a kubernetes ApiClient) whose every attempt to connect gives up after
    `connect_seconds`. The client turns a call's `_request_timeout=t` into urllib3's
    `Timeout(total=t)`, and urllib3 retries a connection that failed (three times by default),
    each retry with the whole `t` again: an address that drops packets held one call for 4 x t
    (two minutes at 30 s). The request's total limit stays `t`."""
    pool = api.rest_client.pool_manager
    urlopen = pool.urlopen

    def bounded(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout")
        total = timeout.total if isinstance(timeout, urllib3.Timeout) else None
        if isinstance(total, int | float):
            kwargs["timeout"] = urllib3.Timeout(total=total, connect=min(connect_seconds, total))
        return urlopen(method, url, *args, **kwargs)

    pool.urlopen = bounded
    return api


def api_client(settings: OperatorSettings) -> kubernetes.client.ApiClient:
    """The operator's client of the Kubernetes API (after `load_config`): its connection
    attempts limited (`limit_connects`), its requests counted (`metrics.API_REQUESTS`)."""
    api = kubernetes.client.ApiClient()
    limited: kubernetes.client.ApiClient = metrics.count_api_requests(
        limit_connects(api, settings.api_connect_timeout_seconds))
    return limited


def default_identity() -> str:
    """The pod name (a pod's hostname) and a random suffix: a restarted container is a new
    candidate, never mistaken for the one that held the Lease before."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Seen:
    """What a candidate last saw of the Lease, and when (its own monotonic clock)."""

    holder: str
    resource_version: str
    lease_duration_seconds: float
    seen_at: float


def may_acquire(seen: Seen | None, identity: str, now: float) -> bool:
    """Whether `identity` may write itself as the holder: the Lease does not exist or has no
    holder, `identity` already holds it, or its record has not changed for a lease duration."""
    if seen is None or not seen.holder or seen.holder == identity:
        return True
    return now - seen.seen_at >= seen.lease_duration_seconds


def _now_micro() -> datetime:
    return datetime.now(UTC)


class LeaseElector:
    """Acquires, renews and releases one Lease for one candidate."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        settings: OperatorSettings,
        identity: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.coordination = kubernetes.client.CoordinationV1Api(api)
        self.namespace = settings.leader_election_namespace
        self.name = settings.leader_election_lease_name
        self.identity = identity or default_identity()
        self.lease_duration = settings.lease_duration_seconds
        self.renew_deadline = settings.lease_renew_deadline_seconds
        self.retry_period = settings.lease_retry_period_seconds
        self.clock = clock
        self.seen: Seen | None = None
        self.renewed_at: float | None = None
        """Monotonic time of our last successful write as holder (None: not the leader)."""
        self.stopping = threading.Event()

    # -- one attempt -----------------------------------------------------------------------------

    def _observe(self, lease: kubernetes.client.V1Lease) -> None:
        spec = lease.spec or kubernetes.client.V1LeaseSpec()
        version = (lease.metadata.resource_version if lease.metadata else None) or ""
        if self.seen is None or self.seen.resource_version != version:
            self.seen = Seen(
                holder=spec.holder_identity or "",
                resource_version=version,
                lease_duration_seconds=float(spec.lease_duration_seconds or self.lease_duration),
                seen_at=self.clock(),
            )

    def try_acquire_or_renew(self) -> bool:
        """One round trip: read the Lease, and write ourselves as its holder when allowed.
        True when we hold it now."""
        timeout = max(1.0, self.renew_deadline / 2)
        try:
            lease = self.coordination.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=timeout)
        except ApiException as error:
            if error.status != 404:
                LOG.warning("reading Lease %s/%s failed: %s", self.namespace, self.name,
                            error.reason)
                return False
            lease = None
        except Exception as error:  # a connection error: try again next period
            LOG.warning("reading Lease %s/%s failed: %s", self.namespace, self.name, error)
            return False
        now = _now_micro()
        duration = max(1, round(self.lease_duration))
        if lease is None:
            body = kubernetes.client.V1Lease(
                metadata=kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=kubernetes.client.V1LeaseSpec(
                    holder_identity=self.identity, lease_duration_seconds=duration,
                    acquire_time=now, renew_time=now, lease_transitions=0),
            )
            write: Callable[[], kubernetes.client.V1Lease] = lambda: (  # noqa: E731
                self.coordination.create_namespaced_lease(
                    self.namespace, body, _request_timeout=timeout))
        else:
            self._observe(lease)
            if not may_acquire(self.seen, self.identity, self.clock()):
                return False
            spec = lease.spec or kubernetes.client.V1LeaseSpec()
            if spec.holder_identity != self.identity:
                LOG.info("taking Lease %s/%s from %r", self.namespace, self.name,
                         spec.holder_identity or None)
                spec.acquire_time = now
                spec.lease_transitions = (spec.lease_transitions or 0) + 1
            spec.holder_identity = self.identity
            spec.lease_duration_seconds = duration
            spec.renew_time = now
            lease.spec = spec
            write = lambda: self.coordination.replace_namespaced_lease(  # noqa: E731
                self.name, self.namespace, lease, _request_timeout=timeout)
        try:
            written = write()
        except ApiException as error:
            if error.status not in (404, 409):  # 409: someone else wrote first
                LOG.warning("writing Lease %s/%s failed: %s", self.namespace, self.name,
                            error.reason)
            return False
        except Exception as error:
            LOG.warning("writing Lease %s/%s failed: %s", self.namespace, self.name, error)
            return False
        self._observe(written)
        self.renewed_at = self.clock()
        return True

    # -- the loops -------------------------------------------------------------------------------

    def acquire(self) -> bool:
        """Block until we hold the Lease (True) or `stop()` was called (False)."""
        LOG.info("waiting to lead: Lease %s/%s, identity %s", self.namespace, self.name,
                 self.identity)
        metrics.LEADER.set(0)
        while not self.stopping.is_set():
            if self.try_acquire_or_renew():
                LOG.info("leading: Lease %s/%s held by %s", self.namespace, self.name,
                         self.identity)
                metrics.LEADER.set(1)
                return True
            self.stopping.wait(self.retry_period)
        return False

    def is_leader(self) -> bool:
        """Whether we renewed the Lease within the renew deadline (a process that was frozen
        past it must not act before its renewal thread has noticed)."""
        renewed = self.renewed_at
        return renewed is not None and self.clock() - renewed < self.renew_deadline

    def keep_renewing(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew every retry period in a daemon thread; call `on_lost` once the renew deadline
        has passed without a successful renewal."""

        def loop() -> None:
            while not self.stopping.wait(self.retry_period):
                if self.try_acquire_or_renew():
                    continue
                if not self.is_leader():
                    metrics.LEADER.set(0)
                    LOG.error("lost Lease %s/%s: not renewed for %g s", self.namespace,
                              self.name, self.renew_deadline)
                    on_lost()
                    return

        thread = threading.Thread(target=loop, name="lease-renewal", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Stop renewing and hand the Lease back (no holder) if we still hold it."""
        self.stopping.set()
        if self.renewed_at is None:
            return
        self.renewed_at = None
        metrics.LEADER.set(0)
        try:
            lease = self.coordination.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=5)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            lease.spec.renew_time = _now_micro()
            self.coordination.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=5)
            LOG.info("released Lease %s/%s", self.namespace, self.name)
        except Exception as error:  # best effort: the lease then expires
            LOG.warning("releasing Lease %s/%s failed: %s", self.namespace, self.name, error)


def exit_now() -> None:
    """Leadership lost: stop at once, whatever kopf is doing (a follower may take over soon)."""
    logging.shutdown()
    os._exit(1)
