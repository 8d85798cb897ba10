"""The operator's verdict that a peer pod is gone: `POST /lost-pods` to a trainer pod's endpoint.

    {"pods": [{"uid": "5b0c...", "name": "job-1", "cause": "PodFailed"}]}

The operator sends it (rtj_operator.decisions.podloss, `scraping.Scraper.announce`); the launcher
shim checks it with `parse_verdict` and keeps it for its workers (rtj_trainer.launcher.verdicts),
which apply it to NVRx's in-process wrapper (rtj_trainer.podloss).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

PATH: Final = "/lost-pods"
MAX_PODS: Final = 64
"""Most pods one verdict may name, and most verdicts a pod keeps."""
MAX_FIELD_CHARS: Final = 253


class VerdictError(ValueError):
    """A verdict document of the wrong shape; the message names the field."""


@dataclass(frozen=True, slots=True)
class LostPod:
    """One pod the operator found gone: every process of it ended."""

    uid: str
    name: str
    cause: str

    def to_json(self) -> dict[str, str]:
        return {"uid": self.uid, "name": self.name, "cause": self.cause}


def document(pods: Iterable[LostPod]) -> dict[str, Any]:
    """The request body naming `pods`."""
    return {"pods": [p.to_json() for p in pods]}


def _text(record: dict[str, Any], key: str, where: str, *, required: bool) -> str:
    value = record.get(key, "")
    if not isinstance(value, str) or len(value) > MAX_FIELD_CHARS or (required and not value):
        raise VerdictError(f"{where}.{key}: expected a {'non-empty ' if required else ''}string "
                           f"of at most {MAX_FIELD_CHARS} characters, got {value!r}")
    return value


def parse_verdict(data: Any) -> list[LostPod]:
    """The pods a verdict (decoded JSON) names; VerdictError names the bad field."""
    if not isinstance(data, dict):
        raise VerdictError("expected a JSON object with a `pods` list")
    pods = data.get("pods")
    if not isinstance(pods, list) or not 1 <= len(pods) <= MAX_PODS:
        raise VerdictError(f"pods: expected a list of 1 to {MAX_PODS} objects, got {pods!r}")
    found = []
    for n, record in enumerate(pods):
        where = f"pods[{n}]"
        if not isinstance(record, dict):
            raise VerdictError(f"{where}: expected an object, got {record!r}")
        found.append(LostPod(uid=_text(record, "uid", where, required=True),
                             name=_text(record, "name", where, required=False),
                             cause=_text(record, "cause", where, required=False)))
    return found
