"""The operator's own errors, as kopf's error classes (kopf decides whether a handler retries).

`InvalidJobError` is permanent: retrying cannot fix a spec the operator cannot parse. It carries
the status patch that tells the user why; the handler writes it and posts a Warning Event.
"""

from __future__ import annotations

from typing import Any

import kopf


class InvalidJobError(kopf.PermanentError):
    """The job's spec cannot be parsed (the CRD's validation normally prevents this)."""

    def __init__(self, message: str, status: dict[str, Any]) -> None:
        super().__init__(message)
        self.status = status
