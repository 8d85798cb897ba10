"""The launcher shim's book of the operator's verdicts on lost peer pods.

The pod endpoint (rtj_trainer.launcher.podmetrics) takes `POST /lost-pods` (rtj_wire.lostpods);
the shim keeps the newest verdicts in a pod-local file, `RTJ_LOST_PODS_FILE`, which it exports to
its workers, who apply them to NVRx's in-process wrapper (rtj_trainer.podloss). It refuses a
verdict naming its own pod.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

from rtj_wire import env as wire_env
from rtj_wire.lostpods import MAX_PODS, LostPod, document

FILE_ENV = wire_env.LOST_PODS_FILE
"""The variable through which the shim tells its workers where its verdict file is."""


def default_file() -> Path:
    """The shim's verdict file when none is configured: pod-local, one per launcher process."""
    return Path(tempfile.gettempdir()) / f"rtj-lost-pods-{os.getpid()}.json"


class VerdictBook:
    """The shim's side: keep the newest verdicts in the pod-local file its workers poll."""

    def __init__(self, path: Path, *, own_uid: str = "") -> None:
        self.path = path
        self.own_uid = own_uid
        self._pods: dict[str, LostPod] = {}
        self._lock = threading.Lock()

    def record(self, pods: Iterable[LostPod]) -> list[LostPod]:
        """Add the verdicts this pod had not heard yet (never one naming this pod itself) and
        rewrite the file at once (readers see the old file or the new one); returns them."""
        with self._lock:
            new = [p for p in pods if p.uid != self.own_uid and p.uid not in self._pods]
            if not new:
                return []
            for pod in new:
                self._pods[pod.uid] = pod
            while len(self._pods) > MAX_PODS:
                del self._pods[next(iter(self._pods))]
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(json.dumps(document(self._pods.values())))
            os.replace(tmp, self.path)
            return new
