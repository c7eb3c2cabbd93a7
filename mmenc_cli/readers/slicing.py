"""Task slices (Slurm arrays: task i of k): which rows of the manifests each task reads.

All manifests, in the given order, form one virtual byte space in which each file occupies its
size in bytes (``.gz`` files occupy none, see below). With T the total, task i owns the half-open
range ``[T*i//k, T*(i+1)//k)``: ranges are disjoint, cover everything, and depend only on the file
sizes, so every task computes the same split without reading any data. Each source's format
(`registry.Format.slicing`) says whether a task reads its byte range of it, every k-th part of it
(taking no room in the byte space), or all of it when its range holds the source's first byte.

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
from ..records import InvalidRow, ManifestRow, NotDownloaded
from .registry import SPREAD, Part, Record, Source


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
        keys = src.fmt.keys(cfg)
        for raw in raws or ():
            if isinstance(raw, (NotDownloaded, InvalidRow)):  # an img2dataset shard's metadata rows
                yield raw
                continue
            line, offset, record, error = raw
            yield src.fmt.row(src.path, line, offset, record, error, keys)
            count += 1
            if count == cfg.limit:
                return


def _records(src: Source, cfg: ManifestConfig, space: tuple[int, int, int],
             pick: tuple[int, int]) -> Iterator[Record] | None:
    """This task's records of one source (as its format reads them): its byte range of a text or
    Parquet manifest, every k-th part of a spread one, a whole source or nothing."""
    lo, hi, total = space
    if src.fmt.slicing == SPREAD:
        return src.fmt.records(src, cfg, Part(pick=pick))
    if src.fmt.taken_whole(src):  # by the task whose range holds its first byte (the last: one at the end)
        last = pick[0] == pick[1] - 1 and src.start == total
        return src.fmt.records(src, cfg, Part()) if lo <= src.start < hi or last else None
    a, b = max(lo - src.start, 0), min(hi - src.start, src.size)
    return src.fmt.records(src, cfg, Part(a, b)) if a < b else None
