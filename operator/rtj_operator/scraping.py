"""Read every running trainer pod's liveness into `RankLiveness`.

One request per pod: the launcher shim serves `GET /ranks` on `<pod IP>:<RTJ_METRICS_PORT - 1>`,
every local rank's heartbeat, step and counters as one JSON document (rtj_wire.ranks,
docs/design.md). A pod whose endpoint refuses the connection (a trainer image without it) is read
the old way, one `GET /metrics` per rank (`RTJ_METRICS_PORT + local rank`), and counts only when
every rank answered.

One `Scraper` serves the whole operator: one long-lived HTTP client, at most
`RTJ_OPERATOR_SCRAPE_CONCURRENCY` requests in flight across every job (plus an eighth of that, at
least 2, for urgent reads: the pods at a heartbeat deadline, which also take a shared slot while
one is free), each bounded by
`RTJ_OPERATOR_SCRAPE_TIMEOUT_SECONDS` (the wait for a free slot does not count). A pod that does
not answer is simply missing from the result: "could not observe" is never "hung" (the decisions
declare a hang only on a stale heartbeat from a pod that answered, and raise
`ObservationDegraded` for a pod that stays silent). Parsing is pure (`rank_sample_from_text`,
`node_liveness_from_json`) and unit-tested.

The same client carries the operator's word to the trainers that a peer pod is gone
(`announce`: `POST /lost-pods` to each running peer's pod endpoint), which lets NVRx's in-process
wrapper in them stop waiting for the lost pod's heartbeats (rtj_operator.decisions.podloss).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rtj_wire import lostpods
from rtj_wire import ranks as wire_ranks
from rtj_wire.pod import pod_endpoint_port
from rtj_wire.ranks import RankRecord

from rtj_operator.intents import AnnouncePodLoss
from rtj_operator.observed import NodeLiveness, PodView, RankLiveness, RankSample


def _sample(record: RankRecord) -> RankSample:
    return RankSample(
        local_rank=record.local_rank, rank=record.rank, heartbeat=record.heartbeat,
        step=record.step, committed_step=record.committed_step,
        committed_time=record.committed_time, goodput_ratio=record.goodput_ratio,
        restarts=dict(record.restarts), standby=record.standby,
        connected_time=record.connected_time)


def rank_sample_from_text(text: str, *, local_rank: int) -> RankSample:
    """A RankSample from one /metrics response (Prometheus text format)."""
    return _sample(RankRecord.from_samples(
        ((sample.name, sample.labels, sample.value)
         for family in text_string_to_metric_families(text) for sample in family.samples),
        local_rank=local_rank))


def node_liveness_from_json(
    text: str | bytes, *, node_index: int, pod_uid: str, procs: int
) -> NodeLiveness:
    """A pod's `GET /ranks` document (rtj_wire.ranks) as its NodeLiveness (ranks that never
    answered are not in it: the pod is then incomplete; `"finished": true`: every local worker
    exited 0). Raises ValueError for a document of another shape."""
    document = wire_ranks.parse_document(json.loads(text))
    samples = {r.local_rank: _sample(r) for r in document.records if r.local_rank < procs}
    return NodeLiveness(node_index=node_index, pod_uid=pod_uid,
                        samples=tuple(samples[r] for r in sorted(samples)), expected_ranks=procs,
                        finished=document.finished)


def readable(pod: PodView) -> bool:
    """Whether a pod has a liveness endpoint to read: a trainer pod running, not deleting, with
    an IP and a node index."""
    return (pod.phase == "Running" and not pod.deleting and bool(pod.pod_ip)
            and pod.node_index is not None)


class Scraper:
    """The operator's one HTTP client for the trainers: a long-lived session (created on first
    use, inside the event loop) and a bound on requests in flight across every job, plus a few
    slots of their own for urgent reads (a heartbeat deadline's), so that they never queue
    behind a read of a thousand pods."""

    def __init__(self, *, concurrency: int, timeout_seconds: float) -> None:
        self.concurrency = concurrency
        self.urgent_concurrency = max(2, concurrency // 8)
        self.timeout_seconds = timeout_seconds
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._urgent_slots: asyncio.Semaphore | None = None

    def _client(self, urgent: bool) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        if (self._session is None or self._session.closed or self._slots is None
                or self._urgent_slots is None):
            connector = aiohttp.TCPConnector(
                limit=self.concurrency + self.urgent_concurrency, limit_per_host=0,
                keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector)
            self._slots = asyncio.Semaphore(self.concurrency)
            self._urgent_slots = asyncio.Semaphore(self.urgent_concurrency)
        if urgent and self._slots.locked():
            return self._session, self._urgent_slots  # the shared slots are all taken
        # An urgent read takes a shared slot while one is free: at 5,000 pods the reads at
        # heartbeat deadlines are most of the reads (500 a second), more than the urgent
        # slots alone carried (detection then lagged 4.5 s behind the deadlines).
        return self._session, self._slots

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, url: str, urgent: bool) -> tuple[int | None, bytes, float]:
        """(HTTP status, body, Unix time the request was sent); status None when refused, 0 on
        any other failure."""
        session, slots = self._client(urgent)
        async with slots:
            sent = time.time()
            try:
                async with session.get(
                    url, timeout=aiohttp.ClientTimeout(total=self.timeout_seconds)
                ) as response:
                    return response.status, await response.read(), sent
            except aiohttp.ClientConnectorError as error:
                refused = isinstance(error.os_error, ConnectionRefusedError)
                return (None if refused else 0), b"", sent
            except (aiohttp.ClientError, TimeoutError, OSError):
                return 0, b"", sent

    async def _post(self, url: str, document: Mapping[str, Any]) -> int:
        """POST `document` as JSON; the HTTP status, 0 on any failure."""
        session, slots = self._client(True)  # urgent: a loss to announce at once
        async with slots:
            try:
                async with session.post(
                    url, json=document, timeout=aiohttp.ClientTimeout(total=self.timeout_seconds)
                ) as response:
                    await response.read()
                    return response.status
            except (aiohttp.ClientError, TimeoutError, OSError):
                return 0

    async def announce(self, announcement: AnnouncePodLoss, *, base_port: int) -> int:
        """Post a lost pod's verdict to every peer's pod endpoint at once (`POST /lost-pods`);
        returns how many peers took it. A peer that does not answer still learns of the loss
        from NVRx's heartbeats, later."""
        port = pod_endpoint_port(base_port)
        statuses = await asyncio.gather(*(
            self._post(f"http://{ip}:{port}{lostpods.PATH}", announcement.document())
            for ip in announcement.peers))
        return sum(1 for status in statuses if status == 200)

    async def _per_rank(self, pod: PodView, base_port: int, procs: int,
                        urgent: bool) -> NodeLiveness | None:
        assert pod.node_index is not None
        pages = await asyncio.gather(*(
            self._get(f"http://{pod.pod_ip}:{base_port + r}/metrics", urgent)
            for r in range(procs)))
        samples = []
        for local_rank, (status, body, _sent) in enumerate(pages):
            if status != 200:
                return None  # a rank that did not answer: the pod is not observed this time
            try:
                samples.append(rank_sample_from_text(body.decode(), local_rank=local_rank))
            except ValueError:
                return None
        return NodeLiveness(node_index=pod.node_index, pod_uid=pod.uid, samples=tuple(samples),
                            expected_ranks=procs, read_time=min(sent for *_, sent in pages))

    async def scrape_pod(self, pod: PodView, *, base_port: int, procs: int,
                         urgent: bool = False) -> NodeLiveness | None:
        """One pod's liveness, or None when it could not be observed. Its `read_time` is when
        the request was sent: the heartbeats in the answer are at least that new, so their age
        is never overstated."""
        assert pod.node_index is not None
        status, body, sent = await self._get(
            f"http://{pod.pod_ip}:{pod_endpoint_port(base_port)}{wire_ranks.PATH}", urgent)
        if status is None:  # no pod endpoint (an older trainer image): one GET per rank
            return await self._per_rank(pod, base_port, procs, urgent)
        if status != 200:
            return None
        try:
            node = node_liveness_from_json(body, node_index=pod.node_index, pod_uid=pod.uid,
                                           procs=procs)
        except ValueError:
            return None
        return dataclasses.replace(node, read_time=sent)

    async def scrape(
        self, pods: Iterable[PodView], *, base_port: int, procs: int, urgent: bool = False
    ) -> RankLiveness:
        """Every running trainer pod that has an IP and answered, by node index; `urgent`
        reads (a few pods at a heartbeat deadline) use their own slots."""
        targets = [pod for pod in pods if readable(pod)]
        if not targets:
            return {}
        nodes = await asyncio.gather(*(
            self.scrape_pod(pod, base_port=base_port, procs=procs, urgent=urgent)
            for pod in targets))
        return {node.node_index: node for node in nodes if node is not None}
