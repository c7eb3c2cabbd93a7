"""Task slices (Slurm arrays: task i of k): which rows of the manifests each task reads.

All manifests, in the given order, form one virtual byte space in which each file occupies its
size in bytes (``.gz`` files occupy none, see below). With T the total, task i owns the half-open
range ``[T*i//k, T*(i+1)//k)``: ranges are disjoint, cover everything, and depend only on the file
sizes, so every task computes the same split without reading any data.

- JSONL / CSV: a record belongs to the task whose range holds the record's first byte. A task
  seeks to its start, skips to the next line start (unless it is at the file start or just after
  a newline) and reads records while their first byte is before its end; the last one may run
  past the end. JSON lines cannot contain raw newlines, so this is exact for JSONL.
- CSV header: every task reads it (rows never start inside it); a task's start inside the header
  becomes the first byte after it.
- CSV records with a quoted field spanning lines make the line-start skip unsafe (it can land
  inside a record). Two modes, chosen by ``cfg.csv_multiline`` (default False):
  * False (byte ranges): fast. Where a file is shared between tasks, a record spanning lines is a
    run-level `ManifestError` telling the user to pass ``csv_multiline``. This is sound as a
    detector: if some task starts inside a record, the nearest such boundary's left neighbour
    started correctly and itself parses that straddling record, so at least one task fails loudly
    (the task that started inside the record may already have emitted a few wrong rows: rerun
    the array with ``csv_multiline``).
  * True: every task parses the file with the csv module from its top (up to its own end) and
    owns the records whose first byte lies in its range: the same ownership rule, so the same rows
    and offsets, exact for any CSV, at the cost of reading the prefix.
  A file owned entirely by one task (including ``task_count == 1``) is always read exactly.
- Parquet: row r of a file with N rows and S bytes sits at ``file_start + r*S//N``; a task takes
  rows ``[ceil(a*N/S), ceil(b*N/S))`` for its local range [a, b), reads only the row groups that
  overlap them (row counts from the footer) and slices rows out of a large row group.
- ``.jsonl.gz`` cannot be seeked: every task decompresses it and keeps its non-blank lines n with
  ``n % k == i``. It takes no room in the byte space (its rows are spread over all tasks anyway).

Line numbers: exact when a task starts at a file's start, in ``csv_multiline`` mode and for
``.gz``; otherwise the task counts newlines before its start only when that prefix is at most
64 MiB (else ``line`` is None; ``offset`` is always exact). `cfg.limit` caps the rows (valid and
invalid) of this task's slice. Duplicate ids are not checked here. Files must not change while
tasks run: the split is computed from their sizes.
"""

from __future__ import annotations

from typing import Iterator

from ..config import ManifestConfig
from ..errors import MMError
from ..records import InvalidRow, ManifestRow, NotDownloaded
from . import img2dataset
from .arrow import arrow_records
from .delimited import csv_records
from .folder import folder_records
from .formats import SPREAD, WHOLE, Source
from .jsonl import jsonl_records
from .lines import Raw
from .parquet import parquet_records
from .tar import tar_records
from .validate import keys_for, to_row


def iter_slice(sources: list[Source], cfg: ManifestConfig, task_index: int,
               task_count: int) -> Iterator[ManifestRow | InvalidRow | NotDownloaded]:
    """Rows of every source within this task's share, up to cfg.limit."""
    if cfg.limit == 0:
        return
    total = sources[-1].start + sources[-1].size if sources else 0
    lo, hi = total * task_index // task_count, total * (task_index + 1) // task_count
    count = 0
    for src in sources:
        raws = _records(src, cfg, (lo, hi, total), (task_index, task_count))
        keys = keys_for(src.fmt, cfg)
        base = src.path if src.fmt in ("folder", "i2d-files") else None
        for raw in raws or ():
            if isinstance(raw, (NotDownloaded, InvalidRow)):  # an img2dataset shard's metadata rows
                yield raw
                continue
            line, offset, record, error = raw
            yield to_row(src.path, line, offset, record, error, keys, base)
            count += 1
            if count == cfg.limit:
                return


def _records(src: Source, cfg: ManifestConfig, space: tuple[int, int, int],
             pick: tuple[int, int]) -> Iterator[Raw | NotDownloaded] | None:
    """This task's records of one source: its byte range of a text or Parquet manifest, every k-th
    part of a spread one, a whole shard or nothing."""
    lo, hi, total = space
    a, b = max(lo - src.start, 0), min(hi - src.start, src.size)
    if src.fmt in SPREAD:
        if src.fmt == "folder":
            return folder_records(src.path, pick, cfg.max_row_bytes)
        if src.fmt == "arrow":
            return arrow_records(src.path, keys_for("arrow", cfg), pick)
        return jsonl_records(src.path, 0, None, cfg.max_row_bytes, pick=pick)
    last = pick[0] == pick[1] - 1 and src.start == total
    if src.fmt in WHOLE or src.fmt == "parquet" and src.size == 0:  # an empty file's error: one owner
        return _whole(src, cfg) if lo <= src.start < hi or last else None
    if a >= b:
        return None
    if src.fmt == "parquet":
        return parquet_records(src, keys_for("parquet", cfg), a, b)
    if src.fmt == "jsonl":
        return jsonl_records(src.path, a, b, cfg.max_row_bytes)
    return csv_records(src, keys_for(src.fmt, cfg), cfg, a, b, cfg.csv_multiline)


def _whole(src: Source, cfg: ManifestConfig) -> Iterator[Raw | NotDownloaded | InvalidRow]:
    """The records of a source a task takes whole: a tar shard, an img2dataset shard (its
    samples, then the rows that were not downloaded), a missing shard's one error row (a missing
    img2dataset shard's metadata rows that were not downloaded still count as such), or an empty
    Parquet file's."""
    if src.fmt in ("missing", "i2d-missing"):
        yield None, 0, None, MMError(_missing(src), stage="read", reason="manifest.missing_shard")
        if src.fmt == "i2d-missing" and src.meta is not None:
            yield from img2dataset.not_downloaded(src.meta)
        return
    if src.fmt == "parquet":
        yield None, 0, None, MMError(f"{src.path} is empty (0 bytes): not a Parquet file", stage="read",
                                     reason="manifest.bad_shard")
        return
    if src.fmt == "tar":
        yield from tar_records(src.path, cfg.max_row_bytes)
    elif src.fmt == "i2d-files":
        yield from folder_records(src.path, None, cfg.max_row_bytes)
    else:
        yield from img2dataset.parquet_samples(src.path)
        return
    if src.meta is not None:
        yield from img2dataset.not_downloaded(src.meta)


def _missing(src: Source) -> str:
    """What a missing source's error row says: who named it."""
    if src.fmt == "i2d-missing":
        return (f"{src.path} does not exist: the samples of this img2dataset shard are missing "
                "(its stats or metadata are there)")
    return f"{src.path} does not exist ({'listed in ' + src.meta if src.meta else 'named by a brace range or pattern'})"
