"""Scrape every trainer rank's Prometheus endpoint into `RankLiveness`.

Each rank serves `GET http://<pod IP>:<RTJ_METRICS_PORT + local rank>/metrics` (metric names in
docs/design.md). All ranks of all running pods are scraped concurrently with a short timeout; a
rank that does not answer is simply missing from its node's samples (the decisions treat a
missing rank as "no news", and a long silence as a hang). Parsing is a pure function
(`rank_sample_from_text`) with its own unit tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from rtj_operator.observed import NodeLiveness, PodView, RankLiveness, RankSample

METRIC_PREFIX = "rtj_trainer_"


def rank_sample_from_text(text: str, *, local_rank: int) -> RankSample:
    """A RankSample from one /metrics response (Prometheus text format)."""
    values: dict[str, float] = {}
    restarts: dict[str, int] = {}
    rank: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(METRIC_PREFIX):
                continue
            name = sample.name[len(METRIC_PREFIX):]
            if "rank" in sample.labels and rank is None:
                try:
                    rank = int(sample.labels["rank"])
                except ValueError:
                    rank = None
            if name == "restarts_total":
                kind = sample.labels.get("kind", "")
                restarts[kind] = int(sample.value)
            elif name not in values:
                values[name] = float(sample.value)

    def integer(name: str) -> int | None:
        value = values.get(name)
        return int(value) if value is not None else None

    committed = integer("checkpoint_committed_step")
    heartbeat = values.get("heartbeat_timestamp_seconds")
    return RankSample(
        local_rank=local_rank,
        rank=rank,
        heartbeat=heartbeat if heartbeat else None,
        step=integer("step"),
        committed_step=committed if committed is not None and committed >= 0 else None,
        committed_time=values.get("checkpoint_committed_timestamp_seconds") or None,
        goodput_ratio=values.get("goodput_ratio"),
        restarts=restarts,
        standby=values.get("standby", 0.0) >= 1.0,
    )


async def _scrape_rank(
    session: aiohttp.ClientSession, url: str, local_rank: int
) -> RankSample | None:
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return None
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    try:
        return rank_sample_from_text(text, local_rank=local_rank)
    except ValueError:
        return None


async def _scrape_node(
    session: aiohttp.ClientSession, pod: PodView, *, base_port: int, procs: int
) -> NodeLiveness:
    assert pod.node_index is not None and pod.pod_ip is not None
    results = await asyncio.gather(*(
        _scrape_rank(session, f"http://{pod.pod_ip}:{base_port + r}/metrics", r)
        for r in range(procs)
    ))
    return NodeLiveness(
        node_index=pod.node_index,
        pod_uid=pod.uid,
        samples=tuple(s for s in results if s is not None),
        expected_ranks=procs,
    )


async def scrape(
    pods: Iterable[PodView], *, base_port: int, procs: int, timeout_seconds: float
) -> RankLiveness:
    """Scrape every rank of every running trainer pod that has an IP."""
    targets = [
        pod for pod in pods
        if pod.phase == "Running" and not pod.deleting and pod.pod_ip
        and pod.node_index is not None
    ]
    if not targets:
        return {}
    timeout = aiohttp.ClientTimeout(total=timeout_seconds)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        nodes = await asyncio.gather(*(
            _scrape_node(session, pod, base_port=base_port, procs=procs) for pod in targets
        ))
    return {node.node_index: node for node in nodes}
