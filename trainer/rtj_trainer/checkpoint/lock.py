"""One job per checkpoint directory: the owner lock `<checkpoint.dir>/.rtj-lock` (`DirectoryLock`).

Why: two jobs given the same explicit `checkpoint.path` would each prune the other's saves
(rtj_trainer.checkpoint.pruning.prune). The check at resume (`refuse_foreign_checkpoints`) sees only
committed checkpoints, so two jobs that start before either commits both pass it. So rank 0 takes
this lock at the start of every attempt (`load_latest`), before it reads anything, and:

- no lock: takes it;
- a lock of this job (another attempt of it, a resumed or replaced pod) or of a job named in
  `spec.checkpoint.resumeFromJobs` (this job continues its run on purpose): takes it over;
- a lock of another job that was refreshed less than `STALE_AFTER_SECONDS` ago: refuses to
  start with the fatal `ForeignCheckpointError`, naming `checkpoint.path` and the other job;
- a lock of another job that nobody refreshed for that long (the job is gone): takes it over,
  with a warning.

While it holds the lock, a daemon thread of rank 0 refreshes its mtime every `REFRESH_SECONDS`
(the heartbeat), and notices when another job took it over meanwhile (`lost`: the Checkpointer
then stops with the same fatal error). A job that finished releases it.

Shared filesystems (FSx for Lustre, NFS) give no lock across nodes, so no fcntl: the lock is a
small JSON file created complete, with a hard link of a temporary file (atomic, and it fails when
the lock exists; `O_CREAT | O_EXCL` where links are not supported) and taken over with an atomic
rename. Like the manifest's job, it guards against a mistake, not an adversary
(docs/security.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from ..errors import ForeignCheckpointError
from .format import CheckpointError

log = logging.getLogger("rtj_trainer.checkpoint.checkpointer")

LOCK = ".rtj-lock"
STALE_AFTER_SECONDS = 600.0
"""A lock of another job not refreshed for this long is taken over (its job is gone)."""
REFRESH_SECONDS = 30.0
"""How often rank 0 refreshes the lock it holds."""
_BEING_WRITTEN_SECONDS = 2.0
"""An unreadable lock this young may be one that `O_CREAT | O_EXCL` just created: look again."""


@dataclass(frozen=True, slots=True)
class Holder:
    """What a lock file says, and when it was last refreshed (its mtime)."""

    job: str | None
    """The job holding it (`format.job_identity`; "" outside a cluster); None: unreadable."""
    identity: str
    host: str
    pid: int
    refreshed_at: float

    def describe(self, now: float) -> str:
        who = "(no job recorded)" if self.job == "" else self.job or "(unreadable lock)"
        where = f", attempt {self.identity} on {self.host} (pid {self.pid})" if self.host else ""
        return f"{who}{where}, refreshed {max(0.0, now - self.refreshed_at):.0f} s ago"


def read_holder(root: Path) -> Holder | None:
    """The lock's holder, or None when there is no lock (OSError when it cannot be read)."""
    path = root / LOCK
    try:
        refreshed_at = path.stat().st_mtime
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        return Holder(str(data["job"]), str(data.get("identity", "")),
                      str(data.get("host", "")), int(data.get("pid", 0)), refreshed_at)
    except (ValueError, TypeError, KeyError, AttributeError):
        return Holder(None, "", "", 0, refreshed_at)


class DirectoryLock:
    """Rank 0's hold on `<root>/.rtj-lock` for `job` (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        *,
        job: str,
        identity: str,
        accepted: Collection[str] = (),
        stale_after_seconds: float = STALE_AFTER_SECONDS,
        refresh_seconds: float = REFRESH_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.job = job
        self.identity = identity
        self.accepted = frozenset(accepted)
        self.stale_after_seconds = stale_after_seconds
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        self.lost: Holder | None = None
        """Set by `refresh` when another job took the lock over: this job must stop."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return self.root / LOCK

    def _content(self) -> str:
        return json.dumps({"job": self.job, "identity": self.identity,
                           "host": socket.gethostname(), "pid": os.getpid(),
                           "taken_at": self.clock()})

    def _temporary(self) -> Path:
        tmp = self.root / f"{LOCK}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as handle:
            handle.write(self._content())
            handle.flush()
            os.fsync(handle.fileno())
        return tmp

    def _create(self) -> bool:
        """Create the lock if there is none (atomic); False when one exists."""
        tmp = self._temporary()
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some FUSE mounts): an exclusive create instead
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as handle:
                handle.write(self._content())
            return True
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _replace(self) -> None:
        os.replace(self._temporary(), self.path)

    def _refusal(self, holder: Holder) -> ForeignCheckpointError:
        return ForeignCheckpointError(
            f"checkpoint.path {self.root} is in use by another job: {holder.describe(self.clock())}"
            f" (its lock {self.path}); this job is {self.job or '(no job)'}. Two jobs on one "
            "checkpoint directory delete each other's checkpoints: give this job its own "
            "checkpoint.path, or stop the other job (a lock not refreshed for "
            f"{self.stale_after_seconds:.0f} s is taken over). To continue that job's run on "
            "purpose, name it in spec.checkpoint.resumeFromJobs (<namespace>/<name>)")

    def take(self) -> None:
        """Take the lock, or raise `ForeignCheckpointError` (fatal) when another job holds it
        and refreshed it less than `stale_after_seconds` ago."""
        self.lost = None
        for _ in range(20):
            holder = read_holder(self.root)
            if holder is None:
                if self._create():
                    return
                continue  # another process created it meanwhile: look at it
            now = self.clock()
            if holder.job is None and now - holder.refreshed_at < _BEING_WRITTEN_SECONDS:
                time.sleep(0.2)
                continue
            if holder.job is not None and (holder.job == self.job or holder.job in self.accepted):
                self._replace()
                return
            if holder.job is not None and now - holder.refreshed_at < self.stale_after_seconds:
                raise self._refusal(holder)
            log.warning("checkpoint.path %s: taking over the lock of %s (not refreshed for "
                        "%.0f s or more: its job is gone); this job is %s", self.root,
                        holder.describe(now), self.stale_after_seconds, self.job or "(no job)")
            self._replace()
            mine = read_holder(self.root)
            if mine is not None and (mine.job, mine.identity) == (self.job, self.identity):
                return
            # Another job took it over at the same moment: look again (it is fresh now).
        raise CheckpointError(f"cannot take the lock {self.path}: it keeps changing hands")

    def refresh(self) -> bool:
        """Mark the lock alive (its mtime). False, with `lost` set, when another job holds it
        now (it took over a lock this job did not refresh in time)."""
        holder = read_holder(self.root)
        if holder is not None and holder.job is not None and holder.job != self.job:
            if self.lost is None:
                log.error("checkpoint.path %s: the lock was taken over by %s; this job (%s) "
                          "stops", self.root, holder.describe(self.clock()), self.job)
            self.lost = holder
            return False
        if holder is None or holder.job is None:
            self._replace()
        else:
            os.utime(self.path)
        return True

    def lost_error(self) -> ForeignCheckpointError | None:
        """The fatal error to stop with once another job took the lock over, else None."""
        return None if self.lost is None else self._refusal(self.lost)

    def keep_alive(self) -> None:
        """Refresh the lock every `refresh_seconds` on a daemon thread until `stop`."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rtj-checkpoint-lock",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            try:
                if not self.refresh():
                    return
            except OSError as exc:  # the store hiccups: try again at the next beat
                log.warning("checkpoint.path %s: cannot refresh the lock: %s", self.root, exc)

    def stop(self) -> None:
        """Stop refreshing (the lock stays: the job's next attempt takes it over)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def release(self) -> None:
        """Stop refreshing and remove the lock if this attempt still holds it (the job is done)."""
        self.stop()
        with contextlib.suppress(OSError):  # best effort: a lock left behind goes stale
            holder = read_holder(self.root)
            if holder is not None and (holder.job, holder.identity) == (self.job, self.identity):
                self.path.unlink()
