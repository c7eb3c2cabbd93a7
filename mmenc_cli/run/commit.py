"""The shard committer: encoded items gathered into shards, written on a background thread.

Committing a shard (`TaskOutput.commit`: its files encoded, written and made visible) runs off the
encode loop, in order, with at most two shards queued. The writer thread never touches the run's
counters: each shard's outcome (`ShardOutcome`: seconds, and the exception when the write failed)
goes back to the encode loop, which collects it with `outcomes()` and counts it. A fault of the
output (disk full, read-only, permission denied) is not the shard's items' fault: the committer
writes nothing more, and the run ends. Anything else that goes wrong on the thread is kept and
re-raised in the encode loop.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import OutputError
from ..output.task import TaskOutput
from ..records import ManifestRow
from ..writers import ShardData, ShardWriter


@dataclass
class ShardOutcome:
    """One shard's write: its rows, the seconds it took, and why it failed (None: committed)."""

    name: str
    shard: ShardData
    seconds: float
    error: Exception | None = None
    fault: bool = False  # the output failed (OSError), not the shard: its items are left for a re-run


class ShardCommitter:
    """Gathers encoded items into shards of `shard_size` and commits them in order."""

    def __init__(self, output: TaskOutput, writer: ShardWriter, shard_size: int, keep: tuple[str, ...],
                 after_commit: Callable[[], None]) -> None:
        self.output, self.writer = output, writer
        self.shard_size, self.keep = shard_size, keep
        self.after_commit = after_commit  # on the writer thread, after each commit (fsync the error report)
        self.shard = self.new_shard()
        self.committed = 0
        self.error: BaseException | None = None
        self.broken: ShardOutcome | None = None  # the output fault that stopped the writing
        self._queue: queue.Queue[ShardData | None] = queue.Queue(maxsize=2)
        self._done: queue.SimpleQueue[ShardOutcome] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="mmenc-writer", daemon=True)
        self._thread.start()

    def new_shard(self) -> ShardData:
        return ShardData(keep={k: [] for k in self.keep})

    def add(self, row: ManifestRow, modality: str, vector: Any, meta: dict[str, Any] | None) -> None:
        """Append one embedding; a full shard goes to the writer thread."""
        self.shard.add(row.id, modality, vector, row.keep, row, meta)
        if len(self.shard) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Hand the shard being filled (if any rows) to the writer thread."""
        if not len(self.shard):
            return
        self._check()
        shard, self.shard = self.shard, self.new_shard()
        while True:
            try:
                self._queue.put(shard, timeout=0.5)
                return
            except queue.Full:
                self._check()

    def outcomes(self) -> list[ShardOutcome]:
        """The shards written (or failed) since the last call; never blocks."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self, check: bool = True) -> list[ShardOutcome]:
        """Write what is queued (not the shard being filled: `flush` it first), stop the thread,
        and return the outcomes not collected yet."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if check:
            self._check()
        return self.outcomes()

    def _check(self) -> None:
        if isinstance(self.error, OutputError):  # e.g. the error report could not be synced
            raise self.error
        if self.error is not None:
            raise RuntimeError(f"the shard writer thread failed: {type(self.error).__name__}: {self.error}") from self.error

    def _work(self) -> None:
        try:
            while (job := self._queue.get()) is not None:
                self._done.put(self._write(job))
        except BaseException as exc:  # never die silently: the encode loop re-raises it
            self.error = exc

    def _write(self, shard: ShardData) -> ShardOutcome:
        if self.broken is not None:  # after an output fault nothing more is written
            return ShardOutcome(self.broken.name, shard, 0.0, self.broken.error, fault=True)
        t0 = time.perf_counter()
        done = self.output.commit(shard, self.writer)
        outcome = ShardOutcome(done.name, shard, time.perf_counter() - t0, done.error, fault=done.fault)
        if done.fault:  # disk full, read-only, gone: the run ends, the items wait for a re-run
            self.broken = outcome
        elif done.error is None:
            self.committed += 1  # committed: from here on nothing may turn its items into errors
            self.after_commit()
        return outcome
