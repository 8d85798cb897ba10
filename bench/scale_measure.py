"""What `bench.scale` measures besides the faults' latencies: when each pod first shows
`Unresponsive` in its job's status (a watch of the jobs), a process's CPU and RSS (from /proc), the
operator's own counters (its /metrics) and the apiserver's request count, and the spread of a
list of latencies.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .asyncapi import Api
from .kubejobs import GROUP_PATH

CLK_TCK = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[int(rank)], 2)


def spread(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": round(max(values), 2) if values else None}


class StatusWatch:
    """Watches the jobs and notes when each pod (name, attempt) first shows `Unresponsive` in
    its job's `status.ranks` (an episode: noted again after it left the state)."""

    def __init__(self, api: Api, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.current: dict[str, set[tuple[str, int | None]]] = {}
        """Job -> the (pod, attempt) Unresponsive in its latest status."""
        self.episodes: list[tuple[float, str, int | None]] = []
        """(when first seen, pod, attempt), in order."""

    def on_job(self, obj: dict[str, Any]) -> None:
        now = time.time()
        name = (obj.get("metadata") or {}).get("name", "")
        ranks = (obj.get("status") or {}).get("ranks") or []
        seen = {(r.get("pod") or "", r.get("attempt")) for r in ranks
                if r.get("state") == "Unresponsive"}
        for pod, attempt in sorted(seen - self.current.get(name, set()), key=str):
            self.episodes.append((now, pod, attempt))
        self.current[name] = seen

    def first_seen(self, pod: str, attempt: int | None) -> float | None:
        return next((t for t, p, a in self.episodes if p == pod and a == attempt), None)

    async def run(self) -> None:
        path = f"{GROUP_PATH}/namespaces/{self.namespace}/resilienttrainingjobs"

        async def on_event(kind: str, obj: dict[str, Any]) -> None:
            if kind in ("ADDED", "MODIFIED"):
                self.on_job(obj)

        await self.api.list_and_watch(path, on_event)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """CPU (cores, per 5 s window) and RSS of one process, sampled every second."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float, int]] = []

    async def run(self) -> None:
        while True:
            try:
                self.samples.append((time.monotonic(), cpu_seconds(self.pid),
                                     rss_bytes(self.pid)))
            except (OSError, ValueError, IndexError):
                return
            await asyncio.sleep(1.0)

    def summary(self, since: float) -> dict[str, Any]:
        rows = [s for s in self.samples if s[0] >= since]
        if len(rows) < 2:
            return {}
        wall = rows[-1][0] - rows[0][0]
        windows = [(rows[i + 5][1] - rows[i][1]) / (rows[i + 5][0] - rows[i][0])
                   for i in range(0, len(rows) - 5)]
        return {"cores_average": round((rows[-1][1] - rows[0][1]) / wall, 3),
                "cores_peak_5s": round(max(windows), 3) if windows else None,
                "rss_mib_max": round(max(r[2] for r in rows) / 2**20, 1),
                "rss_mib_end": round(rows[-1][2] / 2**20, 1)}


async def operator_metrics(port: int) -> dict[str, Any]:
    """The operator's own counters: passes by outcome, pass count and mean duration by what
    woke them, reads of every pod of a job, stale-heartbeat detections and how late they
    were."""
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        text = await r.text()
    passes: dict[str, float] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    single: dict[str, float] = {}
    deadline_reads: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rtj_operator_reconcile_passes_total":
                passes[sample.labels["outcome"]] = sample.value
            elif sample.name == "rtj_operator_reconcile_seconds_sum":
                sums[sample.labels["trigger"]] = sample.value
            elif sample.name == "rtj_operator_reconcile_seconds_count":
                counts[sample.labels["trigger"]] = sample.value
            elif sample.name == "rtj_operator_deadline_reads_total":
                deadline_reads[sample.labels["outcome"]] = sample.value
            elif sample.name.endswith(("_sum", "_count")):
                single[sample.name] = sample.value

    def mean(name: str) -> float | None:
        n = single.get(f"{name}_count")
        return round(single[f"{name}_sum"] / n, 4) if n else None

    return {
        "passes_by_outcome": passes,
        "passes_by_trigger": {k: {"n": int(v), "mean_seconds": round(sums[k] / v, 4)}
                              for k, v in counts.items() if v},
        "deadline_reads_outside_passes": {k: int(v) for k, v in deadline_reads.items()},
        "every_pod_reads": int(single.get("rtj_operator_liveness_read_seconds_count", 0)),
        "every_pod_read_mean_seconds": mean("rtj_operator_liveness_read_seconds"),
        "heartbeat_stale_detections": int(single.get(
            "rtj_operator_heartbeat_stale_detection_seconds_count", 0)),
        "heartbeat_stale_detection_lag_mean_seconds": mean(
            "rtj_operator_heartbeat_stale_detection_seconds"),
    }


async def request_total(api: Api) -> float:
    text = await api.call("GET", "/metrics")
    total = 0.0
    for line in str(text).splitlines():
        if line.startswith("apiserver_request_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
