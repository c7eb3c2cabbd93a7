"""The error report: JSON lines under `OUT/_mmenc/errors/`.

Writing, on the encode loop's failure path. In a local folder (`ErrorReportWriter`), one file per
task and worker: rows are appended and flushed, and fsynced at each shard commit and at the end,
so a committed shard's failures are never lost. In an object store (`PartReportWriter`), where
nothing is appended, rows are written as part objects named after the shard they accompany, each
created once: at each commit, at the end, and at least every `PART_EVERY_S` seconds while only
failures happen; a kill loses at most the rows of the last seconds, whose items are simply tried
again (a re-run reports none twice: the errors commands keep each item's latest row). Reading:
`iter_error_records` gives the raw rows of many reports (what a resume and `mmenc errors` read);
lines that were never valid rows (modality null) are keyed by manifest and `row_locator`.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..errors import OutputError
from ..records import ErrorRecord


class ErrorReportWriter:
    """Append-only JSON-lines writer for one (task, worker). Flushes every row so a kill loses none.

    A torn last line (a writer killed, or out of space, in the middle of a row) is cut off when
    the report is opened again, so the next row never joins it. A failed write is a fault of the
    output (`OutputError`): the run ends.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0
        self.broken = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            cut_torn_tail(path)
            self._fh = open(path, "ab")
        except OSError as exc:
            raise self._fault(exc) from exc

    def _fault(self, exc: OSError) -> OutputError:
        self.broken = True
        return OutputError(f"cannot write the error report {self.path}: {exc.strerror or exc}; "
                           "free the space or fix the permissions, then run the same command")

    def write(self, record: ErrorRecord) -> None:
        """Append one row and flush it to the OS."""
        if self.broken:
            raise OutputError(f"the error report {self.path} could not be written earlier")
        try:
            self._fh.write((record.to_json() + "\n").encode("ascii"))
            self._fh.flush()
        except OSError as exc:
            raise self._fault(exc) from exc
        self.count += 1

    def sync(self) -> None:
        """fsync the report (at shard commits and at the end of the run)."""
        if self.broken:
            return
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as exc:
            raise self._fault(exc) from exc

    def close(self) -> None:
        """Flush, fsync and close (after a fault, just close)."""
        if self._fh.closed:
            return
        try:
            self.sync()
        finally:
            try:
                self._fh.close()
            except OSError:  # the fault was raised already
                pass

    def __enter__(self) -> "ErrorReportWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:  # do not hide the error that ends the run behind a second one
            try:
                self.close()
            except OutputError:
                pass
            return
        self.close()


#: while rows wait and no shard commits, a part is written at least this often
PART_EVERY_S = 30.0


class PartReportWriter:
    """The error report of one (task, worker) in an object store (see the module docstring)."""

    def __init__(self, fs: Any, folder: Any, name: Callable[[int], str]) -> None:
        self.fs, self.folder, self.name = fs, folder, name  # name(k): the k-th part's object name
        self.count, self.broken, self.parts = 0, False, 0
        self._rows: list[str] = []
        self._since = 0.0

    def write(self, record: ErrorRecord) -> None:
        """Keep one row for the next part (written when a part is due)."""
        if not self._rows:
            self._since = time.monotonic()
        self._rows.append(record.to_json() + "\n")
        self.count += 1
        if time.monotonic() - self._since >= PART_EVERY_S:
            self.sync()

    def sync(self) -> None:
        """Write the rows kept as one part object (nothing when there are none)."""
        if not self._rows:
            return
        path = self.folder / self.name(self.parts)
        try:
            self.fs.publish(path, "".join(self._rows).encode("ascii"))
        except OSError as exc:
            self.broken = True
            raise OutputError(f"cannot write the error report {path}: {exc.strerror or exc}; fix the store's "
                              "permissions, then run the same command") from exc
        self.parts += 1
        self._rows.clear()

    def close(self) -> None:
        self.sync()

    def discard(self) -> None:
        """Drop the rows kept (a runner that lost its task to another: that one reports them)."""
        self._rows.clear()


def cut_torn_tail(path: Path) -> int:
    """Cut a last line that has no newline (a row the writer could not finish) off a report;
    return the bytes removed."""
    try:
        fh = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with fh:
        size = fh.seek(0, os.SEEK_END)
        end, keep = size, size
        while end > 0:
            start = max(0, end - (1 << 16))
            fh.seek(start)
            chunk = fh.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                return 0
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end, keep = start, 0
        fh.truncate(keep)
        return size - keep


def iter_error_records(paths: Iterable[Path], damaged: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Read raw report rows from many report files. A torn last line (a killed writer's) is
    skipped; a complete line that is not a JSON row (invalid UTF-8, garbage) is skipped and, when
    `damaged` is given, named there."""
    for path in paths:
        try:
            fh = path.open("rb")  # a local path or a store's (a `upath.UPath`)
        except FileNotFoundError:
            continue
        with fh:
            for number, raw in enumerate(fh, 1):
                text = raw.strip()
                if not text:
                    continue
                try:
                    row = json.loads(text.decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as exc:
                    if raw.endswith(b"\n") and damaged is not None:
                        damaged.append(f"{path}: line {number} is not a report row ({type(exc).__name__})")
                    continue
                if isinstance(row, dict):
                    yield row
                elif damaged is not None:
                    damaged.append(f"{path}: line {number} is not a report row (a JSON {type(row).__name__})")


def row_locator(row: dict[str, Any]) -> str:
    """Where an error row's record is in its input (as `ManifestRow.locator`): its `key`, else its
    offset. A row written before folders were keyed has no `key` field: for a folder's sample its
    id, the relative path, stands in for its place in the walk (which moves)."""
    if "key" in row:
        return str(row["key"]) if row["key"] is not None else str(row.get("offset"))
    if row.get("id") is not None and _is_folder(str(row.get("manifest"))):
        return str(row["id"])
    return str(row.get("offset"))


@functools.lru_cache(maxsize=1024)
def _is_folder(manifest: str) -> bool:
    from ..readers import files

    found = files.info(manifest)
    return found.exists and found.is_dir
