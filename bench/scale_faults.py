"""`bench.scale`'s faults: one at a time at random moments, alternating a hung rank (its heartbeat
freezes) and a killed pod (it turns Failed, exit 137), each timed to the operator's deletion of
the pod (and a hang to its pod first shown `Unresponsive`), with the job whole again before the
next; any other deletion, and an `Unresponsive` pod that was not hung, is a false positive.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp

from .asyncapi import Api
from .kubejobs import GROUP_PATH
from .scale_measure import StatusWatch
from .simnodes import SimPod, Simulator


async def wait_running(api: Api, namespace: str, jobs: int, timeout: float) -> float:
    """Seconds until all `jobs` jobs of the namespace are Running; RuntimeError after `timeout`."""
    started = time.monotonic()
    while True:
        try:
            listing = await api.call("GET", f"{GROUP_PATH}/namespaces/{namespace}/"
                                            "resilienttrainingjobs")
        except (RuntimeError, aiohttp.ClientError, TimeoutError):
            listing = {"items": []}  # an overloaded apiserver: ask again
        states = [(i.get("status") or {}).get("state") for i in listing["items"]]
        if len(states) == jobs and all(s == "Running" for s in states):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"jobs not Running after {timeout:g} s: {states[:10]}")
        await asyncio.sleep(2)


class Faults:
    """Injects the faults into the simulated pods and keeps what came of them."""

    def __init__(self, api: Api, sim: Simulator, watch: StatusWatch, namespace: str, jobs: int,
                 rng: random.Random, hang_threshold: float) -> None:
        self.api = api
        self.sim = sim
        self.watch = watch
        self.namespace = namespace
        self.jobs = jobs
        self.rng = rng
        self.hang_threshold = hang_threshold
        self.expected_deletions: set[str] = set()
        self.hung: set[tuple[str, int | None]] = set()
        self.known_deletions = len(sim.deletions)
        self.known_episodes = len(watch.episodes)
        self.hangs: list[float] = []
        """Hang -> its pod deleted (seconds)."""
        self.hang_detections: list[float] = []
        """Hang -> its pod first `Unresponsive` in the job's status."""
        self.kills: list[float] = []
        """Kill -> its pod deleted."""
        self.false_detections: list[str] = []
        self.misses: list[str] = []
        self.false_positives: list[str] = []
        self.degraded_seen: set[str] = set()

    async def run(self, deadline: float) -> None:
        """Faults until too little time is left for one more (by the monotonic `deadline`), then
        watch the rest of the window."""
        kind = "hang"
        while time.monotonic() < deadline - self.hang_threshold - 15:
            await asyncio.sleep(self.rng.uniform(3, 10))
            self.note_false_positives()
            await self.note_degraded()
            candidates = [p for p in self.sim.pods.values()
                          if p.role == "trainer" and not p.killed and not p.hung
                          and p.uid not in self.sim.deleting_seen]
            if not candidates:
                continue
            target = self.rng.choice(candidates)
            await self.inject(kind, target)
            kind = "kill" if kind == "hang" else "hang"
            if not await self.whole_again(target):
                break
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        self.note_false_positives()
        await self.note_degraded()

    async def inject(self, kind: str, target: SimPod) -> None:
        """One fault, and the moments it is detected and acted on (or a miss)."""
        self.expected_deletions.add(target.uid)
        injected = time.time()
        if kind == "hang":
            self.hung.add((target.name, target.attempt))
            target.hung[self.rng.randrange(self.sim.procs)] = float(int(injected))
        else:
            await self.sim.kill(target)
        limit = injected + (self.hang_threshold + 60 if kind == "hang" else 60)
        while target.uid not in self.sim.deleting_seen and time.time() < limit:
            await asyncio.sleep(0.1)
        seen = self.sim.deleting_seen.get(target.uid)
        if seen is None:
            self.misses.append(f"{kind} {target.name}")
        else:
            (self.hangs if kind == "hang" else self.kills).append(seen - injected)
        if kind == "hang":
            await asyncio.sleep(1)  # the status watch may deliver a moment later
            detected = self.watch.first_seen(target.name, target.attempt)
            if detected is None:
                self.misses.append(f"hang {target.name}: never Unresponsive in status")
            else:
                self.hang_detections.append(detected - injected)

    async def whole_again(self, target: SimPod) -> bool:
        """Wait for the job to be whole again before the next fault: the replacement runs (its
        start restarts the others' heartbeat clocks) and the job says Running. False (a miss
        noted) when it is not."""
        replaced = time.time() + 120
        while time.time() < replaced and not any(
                p.job == target.job and p.index == target.index and p.uid != target.uid
                and p.uid not in self.sim.pending for p in self.sim.pods.values()):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1)
        try:
            await wait_running(self.api, self.namespace, self.jobs, 120)
        except RuntimeError as error:
            self.misses.append(f"not whole again: {error}")
            return False
        return True

    def note_false_positives(self) -> None:
        """Deletions of pods that had no fault, and `Unresponsive` pods that were not hung,
        since the last look."""
        for _at, name, uid in self.sim.deletions[self.known_deletions:]:
            if uid not in self.expected_deletions:
                self.false_positives.append(name)
        self.known_deletions = len(self.sim.deletions)
        for _at, pod, attempt in self.watch.episodes[self.known_episodes:]:
            if (pod, attempt) not in self.hung:
                self.false_detections.append(f"{pod} (attempt {attempt})")
        self.known_episodes = len(self.watch.episodes)

    async def note_degraded(self) -> None:
        """The jobs with ObservationDegraded=True now."""
        listing: dict[str, Any] = await self.api.call(
            "GET", f"{GROUP_PATH}/namespaces/{self.namespace}/resilienttrainingjobs")
        for item in listing["items"]:
            for c in (item.get("status") or {}).get("conditions") or []:
                if c.get("type") == "ObservationDegraded" and c.get("status") == "True":
                    self.degraded_seen.add(item["metadata"]["name"])
