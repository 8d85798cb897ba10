"""The pod endpoint's `GET /ranks` document, and the rank metrics it is made from.

Each local rank of a trainer pod serves its own Prometheus page (`rtj_trainer_*` metrics, labels
`rank` and `local_rank`); the launcher shim reads them over loopback and answers the operator one
small JSON document per pod (rtj_trainer.launcher.podmetrics):

    {"ranks": [{"localRank": 0, "rank": 0, "heartbeat": 1.7e9, "step": 42, "committedStep": 40,
                "committedTime": 1.7e9, "goodputRatio": 0.9, "restarts": {"launcher": 0},
                "standby": false, "answered": true, "source": "metrics"}, ...],
     "finished": true}

Optional keys are left out when unknown. `answered: false` marks a rank that stopped answering
(its last values are kept: its heartbeat goes stale). `source` says where the rank's record comes
from: `metrics` (its own Prometheus page: the trainer, or a script using the trainer's library),
or `nvrx` (only its NVRx rank monitor: a script that sends NVRx heartbeats and nothing else; its
heartbeat is the newest heartbeat or section message the monitor received, `heartbeat` absent
until the first). A rank that neither serves a page nor connected to its rank monitor is not
listed: a pod whose ranks report nothing answers `{"ranks": []}`. `finished` (only when true)
says every local worker exited 0. The operator reads it back with `parse_document`
(rtj_operator.scraping).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

PATH: Final = "/ranks"
METRICS_SOURCE: Final = "metrics"
NVRX_SOURCE: Final = "nvrx"

METRIC_PREFIX: Final = "rtj_trainer_"
HEARTBEAT: Final = "heartbeat_timestamp_seconds"
"""Unix time of the rank's last heartbeat (0: none yet)."""
STEP: Final = "step"
COMMITTED_STEP: Final = "checkpoint_committed_step"
"""The newest committed checkpoint's step (-1: none)."""
COMMITTED_TIME: Final = "checkpoint_committed_timestamp_seconds"
GOODPUT: Final = "goodput_ratio"
RESTARTS: Final = "restarts_total"
"""A counter with a `kind` label (`inprocess`, `launcher`, `pod`)."""
STANDBY: Final = "standby"
"""1 while the rank is a warm spare waiting to take over."""
RANK_LABEL: Final = "rank"
KIND_LABEL: Final = "kind"

Sample = tuple[str, Mapping[str, str], float]
"""One sample of a Prometheus page: (full metric name, labels, value)."""


@dataclass(frozen=True, kw_only=True)
class RankRecord:
    """One local rank as the pod endpoint reports it."""

    local_rank: int
    rank: int | None = None
    heartbeat: float | None = None
    """Unix time of the rank's last heartbeat; None before the first."""
    step: int | None = None
    committed_step: int | None = None
    committed_time: float | None = None
    goodput_ratio: float | None = None
    restarts: Mapping[str, int] = field(default_factory=dict)
    standby: bool = False
    answered: bool = True
    """False: the rank stopped answering; these are its last values."""
    source: str = METRICS_SOURCE
    """`metrics` or `nvrx` (the module docstring)."""
    connected_time: float | None = None
    """`nvrx` only: when the rank's worker connected to its rank monitor (its timers start
    there, as the monitor's own do)."""

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"localRank": self.local_rank, "rank": self.rank,
                                  "restarts": dict(self.restarts), "standby": self.standby,
                                  "answered": self.answered, "source": self.source}
        for key, value in (("heartbeat", self.heartbeat), ("step", self.step),
                           ("committedStep", self.committed_step),
                           ("committedTime", self.committed_time),
                           ("goodputRatio", self.goodput_ratio),
                           ("connectedTime", self.connected_time)):
            if value is not None:
                record[key] = value
        return record

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> RankRecord:
        """One entry of the document; ValueError names a bad key."""
        local_rank = record.get("localRank")
        if not isinstance(local_rank, int) or isinstance(local_rank, bool) or local_rank < 0:
            raise ValueError(f"ranks[].localRank: expected an integer >= 0, got {local_rank!r}")
        rank = record.get("rank")
        step = _number(record, "step")
        committed = _number(record, "committedStep")
        restarts = record.get("restarts") or {}
        return cls(
            local_rank=local_rank,
            rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
            heartbeat=_number(record, "heartbeat") or None,
            step=int(step) if step is not None else None,
            committed_step=int(committed) if committed is not None and committed >= 0 else None,
            committed_time=_number(record, "committedTime") or None,
            goodput_ratio=_number(record, "goodputRatio"),
            restarts={str(k): int(v) for k, v in restarts.items()
                      if isinstance(v, int | float) and not isinstance(v, bool)}
            if isinstance(restarts, dict) else {},
            standby=record.get("standby") is True,
            answered=record.get("answered") is not False,
            source=NVRX_SOURCE if record.get("source") == NVRX_SOURCE else METRICS_SOURCE,
            connected_time=_number(record, "connectedTime") or None,
        )

    @classmethod
    def from_samples(cls, samples: Iterable[Sample], *, local_rank: int) -> RankRecord:
        """A rank's Prometheus page (its samples, as any parser of the text format gives them)
        as its record. Metrics of other prefixes are ignored; the first value of a name wins."""
        values: dict[str, float] = {}
        restarts: dict[str, int] = {}
        rank: int | None = None
        for full_name, labels, value in samples:
            if not full_name.startswith(METRIC_PREFIX):
                continue
            name = full_name[len(METRIC_PREFIX):]
            if rank is None and RANK_LABEL in labels:
                try:
                    rank = int(labels[RANK_LABEL])
                except ValueError:
                    rank = None
            if name == RESTARTS:
                restarts[labels.get(KIND_LABEL, "")] = int(value)
            elif name not in values:
                values[name] = float(value)

        def integer(name: str) -> int | None:
            value = values.get(name)
            return int(value) if value is not None and math.isfinite(value) else None

        committed = integer(COMMITTED_STEP)
        return cls(
            local_rank=local_rank, rank=rank,
            heartbeat=values.get(HEARTBEAT) or None,
            step=integer(STEP),
            committed_step=committed if committed is not None and committed >= 0 else None,
            committed_time=values.get(COMMITTED_TIME) or None,
            goodput_ratio=values.get(GOODPUT),
            restarts=restarts,
            standby=values.get(STANDBY, 0.0) >= 1.0,
        )


def _number(record: Mapping[str, Any], key: str) -> float | None:
    value = record.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def document(records: Iterable[RankRecord], *, finished: bool = False) -> dict[str, Any]:
    """The JSON document `GET /ranks` answers."""
    body: dict[str, Any] = {"ranks": [r.to_json() for r in records]}
    if finished:
        body["finished"] = True
    return body


@dataclass(frozen=True, kw_only=True)
class PodRanks:
    """A parsed `GET /ranks` document."""

    records: tuple[RankRecord, ...]
    finished: bool = False


def parse_document(data: Any) -> PodRanks:
    """The document (already decoded from JSON) back; ValueError for another shape."""
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list):
        raise ValueError("expected a JSON object with a `ranks` list")
    records = []
    for entry in ranks:
        if not isinstance(entry, dict):
            raise ValueError("ranks[]: expected objects")
        records.append(RankRecord.from_json(entry))
    return PodRanks(records=tuple(records), finished=data.get("finished") is True)
