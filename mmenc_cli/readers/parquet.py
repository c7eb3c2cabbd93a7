"""Parquet manifests: streamed by row group, only the columns a row needs.

Damage never ends the run: a file whose footer cannot be read is one `manifest.bad_shard` row
(all its rows are lost; the task holding its first byte reports it), a row group that cannot be
decoded (or decodes to fewer rows than the footer says) is one such row for its rows, and the file
is read on from the next row group, each row at the index the footer gives it; a batch that
decodes is validated in full before it becomes records (`batches.py`).

Task slices: row r of a file of N rows and S bytes sits at byte r*S//N of its room in the byte
space (`slicing.py`); an empty file is one task's. `offset` is the row's index in the file.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from . import files
from .batches import checked_records, find_row, lost_rows, read_errors
from .lines import Raw
from .registry import RANGES, Format, Part, Source, register
from .validate import Keys, check_columns

PARQUET_BATCH = 256  # rows converted to Python at once: inline images make rows large
#: (path, size) -> the rows its footer says, while it is read: where a row sits, for progress
_ROWS: dict[tuple[str, int], int] = {}


def parquet_file(path: str) -> Any:
    """Open a Parquet manifest for streaming (buffered column reads, no whole-row-group buffer);
    ManifestError when its footer cannot be read."""
    try:
        return open_parquet(path)[0]
    except read_errors() as exc:
        raise ManifestError(f"cannot read Parquet manifest {path}: {exc}") from None


def open_parquet(path: str) -> tuple[Any, list[str]]:
    """A Parquet file opened for streaming and its column names; pyarrow's error (or OSError, or
    a UnicodeDecodeError from a damaged schema) when it cannot be opened."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(files.open_binary(path) if files.is_url(path) else path, buffer_size=1 << 20,
                        pre_buffer=False)
    try:
        return pf, list(pf.schema_arrow.names)
    except BaseException:
        pf.close()
        raise


def unopenable(path: str, exc: BaseException) -> MMError:
    """The error row of a Parquet file that cannot be opened at all."""
    return MMError(f"{path} cannot be opened as Parquet ({type(exc).__name__}: {exc}): all its rows are lost",
                   stage="read", reason="manifest.bad_shard")


def parquet_records(src: Source, keys: Keys, a: int, b: int) -> Iterator[Raw]:
    """Parquet rows whose virtual position r*S//N lies in [a, b), reading only their row groups."""
    try:
        pf, names = open_parquet(src.path)
    except read_errors() as exc:
        if a == 0:  # the task that holds the file's first byte
            yield None, 0, None, unopenable(src.path, exc)
        return
    with pf:
        check_columns(names, src.path, keys)
        n = pf.metadata.num_rows
        lo, hi = -(-a * n // src.size), -(-b * n // src.size)
        _ROWS[(src.path, src.size)] = n
        try:
            yield from parquet_rows(pf, src.path, [c for c in keys.columns if c in names], lo, hi)
        finally:
            _ROWS.pop((src.path, src.size), None)


def parquet_rows(pf: Any, path: str, columns: list[str] | None, lo: int = 0,
                 hi: int | None = None) -> Iterator[Raw]:
    """Rows [lo, hi) of an open Parquet file (`columns` only, None: all), reading only the row
    groups they lie in; rows that cannot be read are error rows and reading goes on."""
    meta = pf.metadata
    hi = meta.num_rows if hi is None else hi
    starts, row = [], 0
    for g in range(meta.num_row_groups):
        starts.append(row)
        row += meta.row_group(g).num_rows
    starts.append(row)
    groups = [g for g in range(meta.num_row_groups) if starts[g] < hi and starts[g + 1] > lo]
    done = lo  # rows before it were given (a re-read group starts over)
    for first, batch, count, exc in _read(pf, groups, starts, columns):
        i, j = max(done, first), min(hi, first + count)
        if j > i:
            if batch is None:
                yield None, i, None, lost_rows(path, i, j - i, exc)
            else:
                yield from checked_records(batch.slice(i - first, j - i), path, i)
            done = j
        if done >= hi:
            return


def _read(pf: Any, groups: list[int], starts: list[int],
          columns: list[str] | None) -> Iterator[tuple[int, Any, int, BaseException | str | None]]:
    """(first row, batch, rows, None) for the batches of `groups`; (first row, None, rows lost, the
    cause) for the part of a row group that cannot be read. Read one group at a time (batches may
    span groups): a damaged group then loses only its own rows, and every row keeps the index the
    footer gives it even where a group decodes to fewer rows than it says."""
    for g in groups:
        at, end = starts[g], starts[g + 1]
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=[g], columns=columns):
                batch = batch.slice(0, end - at)  # rows past what the footer says are not rows of the file
                yield at, batch, batch.num_rows, None
                at += batch.num_rows
        except read_errors() as exc:
            yield at, None, end - at, exc
            continue
        if at < end:
            yield at, None, end - at, f"row group {g} holds {at - starts[g]} rows, its footer says {end - starts[g]}"


def parquet_record(path: str, offset: int) -> dict[str, Any]:
    """Row `offset` of a Parquet file with all its columns, streaming only its row group."""
    with parquet_file(path) as pf:
        meta = pf.metadata
        if offset >= meta.num_rows:
            raise ManifestError(f"row {offset} is past the end of {path} ({meta.num_rows} rows)")
        row = 0
        for g in range(meta.num_row_groups):
            if offset < row + meta.row_group(g).num_rows:
                break
            row += meta.row_group(g).num_rows
        found = find_row(pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=[g]), offset, path, row)
    if found is None:
        raise ManifestError(f"row {offset} not found in {path}")  # metadata and data disagree
    return found


class Parquet(Format):
    """`.parquet`: rows placed by size in the byte space, each task reading the row groups its rows are in."""

    name, extensions, slicing = "parquet", (".parquet",), RANGES

    def taken_whole(self, src: Source) -> bool:
        """An empty file's one error row belongs to one task."""
        return src.size == 0

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Raw]:
        """The rows placed in the task's byte range (an empty file: its error row)."""
        if src.size == 0:
            return iter([(None, 0, None, MMError(f"{src.path} is empty (0 bytes): not a Parquet file", stage="read",
                                                 reason="manifest.bad_shard"))])
        assert part.b is not None
        return parquet_records(src, self.keys(cfg), part.a, part.b)

    def position(self, src: Source, offset: int) -> int | None:
        """Row r of N sits at byte r*S//N (N from the footer its reader opened)."""
        rows = _ROWS.get((src.path, src.size))
        return offset * src.size // rows if rows else None

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """Row `offset`, all its columns."""
        return parquet_record(path, offset), None


PARQUET = register(Parquet())
