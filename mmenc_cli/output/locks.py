"""Task locks: one flock per (output folder, task), so overlapping runs of a task never mix.

The kernel drops an flock when its process dies, so a lock left by a killed run is stale by
construction; the host, pid and start time recorded in the file only serve the message shown to
a second run. `OutDir.lock` names the file (`_mmenc/locks/task-NNNNN.lock`).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ..clock import timestamp
from ..errors import LockBusy, LockWaitInterrupted, OutputError

__all__ = ["LockBusy", "LockWaitInterrupted", "TaskLock"]


class TaskLock:
    """An flock on one lock file that records the holder's host, pid and start time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def holder(self) -> dict[str, Any] | None:
        """Who holds (or last held) the lock, as recorded in the file."""
        try:
            text = self.path.read_text(encoding="utf-8")
            return json.loads(text) if text.strip() else None
        except (OSError, json.JSONDecodeError):
            return None

    def is_held(self) -> bool:
        """True when a live process holds this lock (probed read-only, released at once)."""
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise OutputError(f"cannot probe the task lock {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return True
            raise
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    def acquire(self, wait: bool = False, poll: float = 1.0, stop: Any = None) -> None:
        """Take the lock, waiting (polling) when `wait`, else raising LockBusy at once."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                if not wait:
                    holder = self.holder() or {}
                    os.close(fd)
                    who = f"{holder.get('host', '?')} pid {holder.get('pid', '?')} since {holder.get('since', '?')}"
                    raise LockBusy(f"another mmenc run holds {self.path} ({who}); use --wait-lock to wait") from None
                if stop is not None and stop.wait(poll):  # SIGTERM/SIGINT while waiting: give up
                    os.close(fd)
                    raise LockWaitInterrupted(f"interrupted while waiting for {self.path}")
                if stop is None:
                    time.sleep(poll)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": timestamp()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays; its content is informative only)."""
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "TaskLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
