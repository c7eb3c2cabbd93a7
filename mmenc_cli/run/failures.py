"""How a failure becomes an error row: the one place that writes the report and counts the failure.

Each stage returns its failures as data (`MMError`s with the item or the line they belong to); the
encode loop hands them here. `record` writes one `ErrorRecord` (with the attempt number, one more
than earlier runs recorded for the item) and counts it; with --fail-fast the first one stops the
run.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..errors import MMError, OutputError
from ..idset import AttemptCounts, id_hash
from ..media.sources import describe_source
from ..records import InvalidRow, ManifestRow
from ..records import ErrorRecord
from ..output.task import TaskOutput
from .counters import Counters


class FailureSink:
    """Writes error rows of one (task, worker) and counts them; `sync` makes them durable."""

    def __init__(self, output: TaskOutput, counters: Counters, attempts: AttemptCounts, task: int,
                 on_failure: Callable[[], None]) -> None:
        self.output, self.counters, self.attempts, self.task = output, counters, attempts, task
        self.on_failure = on_failure  # --fail-fast: stop the run
        self._lock = threading.Lock()  # the writer thread syncs while the loop appends

    def record(self, err: MMError, row: ManifestRow, modality: str) -> None:
        """One item (row, modality) failed (not attempted when its row cannot be written: the run ends)."""
        attempt = self.attempts.get(id_hash(row.id, modality)) + 1
        source = describe_source(row.value(modality)) if modality != "text" else None
        try:
            self._write(ErrorRecord.from_error(err, id=row.id, manifest=row.manifest, line=row.line,
                                               offset=row.offset, modality=modality, source=source, attempt=attempt,
                                               task=self.task, key=row.key))
        except OutputError:
            self.counters.add(modality, "not_attempted")
            raise
        self.counters.add_failure(modality, err.code)

    def record_invalid(self, invalid: InvalidRow) -> None:
        """One manifest line is not a valid row (modality null)."""
        self._write(ErrorRecord.from_error(invalid.error, id=invalid.id, manifest=invalid.manifest, line=invalid.line,
                                           offset=invalid.offset, modality=None, task=self.task, key=invalid.key))
        self.counters.add_row("invalid")

    def resolve_line(self, row: ManifestRow) -> None:
        """The manifest line of `row` was an invalid line in an earlier run: mark it resolved."""
        with self._lock:
            self.output.flush_report([ErrorRecord.resolved(id=row.id, manifest=row.manifest, line=row.line,
                                                           offset=row.offset, task=self.task, key=row.key)], sync=False)

    def _write(self, record: ErrorRecord) -> None:
        with self._lock:
            self.output.flush_report([record], sync=False)  # flushed to the OS: a kill loses no row
        self.on_failure()

    def sync(self) -> None:
        """fsync the report (at shard commits): a committed shard's failures are never lost."""
        with self._lock:
            self.output.flush_report([], sync=True)
