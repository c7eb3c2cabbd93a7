"""A task's claim on an output in an object store, where no flock exists: its record says it is
running, with a heartbeat it renews every `HEARTBEAT_S` seconds.

A run that finds its task's record running with a heartbeat younger than `STALE_S` stops with
exit 75 (or waits, with `--wait-lock`); an older heartbeat is a crashed run's, and the task is
taken over, as is a record whose run was on this host and whose process is gone (a kill). Two
runners that start within the same moment both pass this check; the store's exclusive create
settles them at the first shard name they share (`OutDir.publish_shard`), so they never both commit
the same items. `mmenc status` reads the heartbeat to tell "running"
from "crashed".
"""

from __future__ import annotations

import os
import platform
import threading
import time
import uuid
from typing import Any, Callable

from ..errors import LockBusy, LockWaitInterrupted
from ..stopping import bounded, join
from .fs import read_json

HEARTBEAT_S = 60.0
#: a heartbeat older than this is a crashed run's (three missed beats)
STALE_S = 3 * HEARTBEAT_S
_POLL_S = 5.0


def alive(record: Any, now: float | None = None) -> bool:
    """Whether a task record says running with a fresh heartbeat, and its process is not known
    dead (a run on this host whose pid is gone was killed, however fresh its last beat)."""
    if not isinstance(record, dict) or record.get("state") != "running":
        return False
    beat = record.get("heartbeat")
    fresh = isinstance(beat, (int, float)) and (now if now is not None else time.time()) - beat < STALE_S
    return fresh and not _dead_here(record)


def _dead_here(record: dict[str, Any]) -> bool:
    """Whether the record's run was on this host and its process is gone (a kill: no need to wait
    for its heartbeat to go stale)."""
    if record.get("host") != platform.node() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists, owned by another user
        return False
    return False


class Lease:
    """A task's claim in a store (see the module docstring): `claim`, then `renew_with` keeps the
    heartbeat going until `release`."""

    def __init__(self, record_path: Any, task: int) -> None:
        self.record_path, self.task = record_path, task
        self.runner = uuid.uuid4().hex[:12]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def claim(self, wait: bool = False, stop: Any = None) -> None:
        """LockBusy when a live run holds the task (with `wait`: wait until it ends or goes stale;
        LockWaitInterrupted when `stop` is set meanwhile)."""
        while True:
            record = bounded(lambda: read_json(self.record_path), f"reading {self.record_path}")
            if not alive(record) or record.get("runner") == self.runner:
                return
            age = time.time() - float(record["heartbeat"])
            if not wait:
                raise LockBusy(f"task {self.task} of {self.record_path} is running on {record.get('host')} "
                               f"(pid {record.get('pid')}, heartbeat {age:.0f} s ago); it is taken over once its "
                               f"heartbeat is {STALE_S:.0f} s old, or pass --wait-lock to wait")
            if stop is not None and stop.wait(_POLL_S):
                raise LockWaitInterrupted()
            if stop is None:
                time.sleep(_POLL_S)

    def stamp(self, record: dict[str, Any]) -> dict[str, Any]:
        """`record` with this runner and a fresh heartbeat."""
        return {**record, "runner": self.runner, "heartbeat": time.time()}

    def renew_with(self, write: Callable[[], None]) -> None:
        """Call `write` (rewriting the record with a fresh heartbeat) every `HEARTBEAT_S` seconds
        on a background thread, until `release`; a failed write is tried again at the next beat."""
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    write()
                except Exception:  # a store hiccup: the next beat tries again before the lease goes stale
                    pass

        self._thread = threading.Thread(target=beat, name="mmenc-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat (the final record is written by the task's close). A beat that a
        store keeps waiting is left behind once a stop request's grace is over."""
        self._stop.set()
        if self._thread is not None:
            join(self._thread)
            self._thread = None
