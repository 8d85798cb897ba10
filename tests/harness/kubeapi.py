"""A small, dependency-free Kubernetes REST client (stdlib `http.client` + `ssl`).

The node harness runs in its own process and talks to the API server a lot (watches, status
patches, leases). Plain dicts and one keep-alive connection per thread keep it light and fast,
and avoid depending on the `kubernetes` package's model classes.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JsonObject = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class ApiError(Exception):
    """The API server answered with a non-2xx status."""

    def __init__(self, status: int, body: str, method: str, path: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to authenticate (client certificate)."""

    server: str
    ca_file: Path
    cert_file: Path
    key_file: Path

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Credentials:
        """Reads the harness's own kubeconfig (JSON, one cluster/user, file references)."""
        config = json.loads(path.read_text())
        cluster = config["clusters"][0]["cluster"]
        user = config["users"][0]["user"]
        return cls(
            server=cluster["server"],
            ca_file=Path(cluster["certificate-authority"]),
            cert_file=Path(user["client-certificate"]),
            key_file=Path(user["client-key"]),
        )


class KubeApi:
    """Thread-safe: each thread gets its own HTTPS connection."""

    def __init__(self, credentials: Credentials, timeout: float = 30.0) -> None:
        self.credentials = credentials
        url = urllib.parse.urlsplit(credentials.server)
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or 443
        self._timeout = timeout
        self._ssl = ssl.create_default_context(cafile=str(credentials.ca_file))
        self._ssl.load_cert_chain(str(credentials.cert_file), str(credentials.key_file))
        self._local = threading.local()

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeApi:
        return cls(Credentials.from_kubeconfig(path))

    def _connection(self, timeout: float | None = None) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            self._host, self._port, context=self._ssl, timeout=timeout or self._timeout
        )

    def request(
        self,
        method: str,
        path: str,
        body: JsonObject | None = None,
        *,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JsonObject:
        """One API call; returns the decoded JSON answer, raises ApiError on non-2xx."""
        if params:
            path = f"{path}?{urllib.parse.urlencode(params)}"
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json"}
        if payload is not None:
            headers["Content-Type"] = content_type
        for attempt in (1, 2):
            conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = self._connection()
            try:
                conn.request(method, path, body=payload, headers=headers)
                response = conn.getresponse()
                text = response.read().decode()
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if not 200 <= response.status < 300:
                raise ApiError(response.status, text, method, path)
            return json.loads(text) if text else {}
        raise AssertionError("unreachable")

    def get(self, path: str, **params: str) -> JsonObject:
        return self.request("GET", path, params=params or None)

    def get_or_none(self, path: str) -> JsonObject | None:
        try:
            return self.get(path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def create(self, path: str, body: JsonObject) -> JsonObject:
        return self.request("POST", path, body)

    def patch(self, path: str, body: JsonObject, *, strategic: bool = False) -> JsonObject:
        kind = STRATEGIC_MERGE_PATCH if strategic else MERGE_PATCH
        return self.request("PATCH", path, body, content_type=kind)

    def delete(self, path: str, body: JsonObject | None = None) -> JsonObject | None:
        """DELETE; a 404 (already gone) returns None."""
        try:
            return self.request("DELETE", path, body)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def watch(
        self, path: str, resource_version: str, timeout_seconds: int = 290
    ) -> Iterator[JsonObject]:
        """Yields watch events ({type, object}) until the server ends the stream."""
        params = {
            "watch": "1",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_seconds),
        }
        conn = self._connection(timeout=timeout_seconds + 30)
        try:
            conn.request("GET", f"{path}?{urllib.parse.urlencode(params)}")
            response = conn.getresponse()
            if response.status != 200:
                raise ApiError(response.status, response.read().decode(), "WATCH", path)
            while True:
                line = response.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()
