"""A small asyncio client for the test harness's kube-apiserver (its admin client certificate),
for `bench.scale`: thousands of simulated pods are bound, started and deleted from one asyncio
loop, which also serves their liveness endpoints, so the calls must not block it (the harness's
own client, `harness.kubeapi`, is synchronous, one connection per thread). An overloaded
apiserver is slow, not wrong: timeouts, dropped connections and 429/5xx answers are retried.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

TRANSIENT = (429, 500, 502, 503, 504)
"""API answers the client retries (an overloaded apiserver)."""


class Api:
    """The apiserver at `server`, with the harness's admin certificate from `pki`. `requests`
    counts every request sent (retries and watches included), so that a benchmark can tell its
    own requests from the operator's."""

    def __init__(self, server: str, pki: Path) -> None:
        self.server = server
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=32),
            timeout=aiohttp.ClientTimeout(total=60))
        self.requests = 0

    async def call(self, method: str, path: str, body: Any = None, *,
                   content_type: str = "application/json", ok: tuple[int, ...] = (),
                   attempts: int = 6) -> Any:
        """One API call; a timeout, a dropped connection or a 429/5xx answer is retried
        (`attempts` in all, backing off from 0.5 s): an overloaded apiserver is slow, not
        wrong."""
        data = json.dumps(body) if body is not None else None
        for attempt in range(attempts):
            self.requests += 1
            last = attempt == attempts - 1
            try:
                async with self.session.request(
                        method, self.server + path, data=data,
                        headers={"Content-Type": content_type}) as response:
                    text = await response.text()
                    if response.status in TRANSIENT and not last:
                        await asyncio.sleep(0.5 * 2 ** attempt)
                        continue
                    if response.status >= 400 and response.status not in ok:
                        raise RuntimeError(f"{method} {path}: {response.status} {text[:300]}")
                    return json.loads(text) if text and text.startswith("{") else text
            except (TimeoutError, aiohttp.ClientError):
                if last:
                    raise
                await asyncio.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def list_and_watch(
        self, path: str, on_event: Callable[[str, dict[str, Any]], Awaitable[None]],
        selector: str = "",
    ) -> None:
        """For ever: list `path` (only the objects with label `selector`, when given; every item
        handed to `on_event` as ADDED), then watch it from the list's resourceVersion; list again
        when the watch ends or fails (after 0.5 s when it failed)."""
        query = f"labelSelector={selector}&" if selector else ""
        while True:
            try:
                listing = await self.call("GET", f"{path}?{query}".rstrip("?&"))
                for item in listing["items"]:
                    item.setdefault("metadata", {})
                    await on_event("ADDED", item)
                url = (f"{self.server}{path}?{query}watch=1"
                       f"&resourceVersion={listing['metadata']['resourceVersion']}"
                       "&allowWatchBookmarks=false")
                self.requests += 1
                async with self.session.get(
                        url, timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as stream:
                    async for line in stream.content:
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        if event["type"] == "ERROR":  # e.g. 410 Gone: the stream ends; list again
                            break
                        await on_event(event["type"], event["object"])
            except (TimeoutError, aiohttp.ClientError, RuntimeError):
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        await self.session.close()
