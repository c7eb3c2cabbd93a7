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

from dataclasses import dataclass
from typing import Iterator

from ..config import ManifestConfig
from ..records import InvalidRow, ManifestRow, NotDownloaded
from .registry import SPREAD, Part, Record, Source


@dataclass
class Reading:
    """How far a task has read its slice, for progress: `done` of `total` in `unit`. The unit is
    "bytes" of the tasks' byte space (Parquet rows placed by size, as the slices place them), or
    "rows" under `cfg.limit`. `total` is known up front from the sizes alone (no data read) and
    None where it is not: a spread source whose format cannot say (`.jsonl.gz`, folders) or no
    input at all. Every task passes through the whole of an Arrow file: it counts its size."""

    total: int | None = None
    unit: str = "bytes"
    done: int = 0


def work_size(sources: list[Source], cfg: ManifestConfig, task_index: int, task_count: int) -> Reading:
    """The size of a task's slice (`Reading.total`), with nothing read yet."""
    if cfg.limit is not None:
        return Reading(total=cfg.limit, unit="rows")
    space = _space(sources, task_index, task_count)
    rooms = [_room(src, part) for src in sources if (part := _part(src, space, (task_index, task_count)))]
    return Reading(total=None if not sources or None in rooms else sum(r or 0 for r in rooms))


def iter_slice(sources: list[Source], cfg: ManifestConfig, task_index: int, task_count: int,
               reading: Reading | None = None) -> Iterator[ManifestRow | InvalidRow | NotDownloaded]:
    """Rows of every source within this task's share, up to cfg.limit; `reading` (from
    `work_size`) follows the position reached, each row's before it is yielded."""
    if cfg.limit == 0:
        return
    reading = reading or Reading()
    space = _space(sources, task_index, task_count)
    by_rows, count = reading.unit == "rows", 0
    for src in sources:
        part = _part(src, space, (task_index, task_count))
        if part is None:
            continue
        room, base, keys, a = _room(src, part) or 0, reading.done, src.fmt.keys(cfg), part.a
        position = src.fmt.position if room and not by_rows else None  # looked up once: it runs per row
        for raw in src.fmt.records(src, cfg, part):
            if isinstance(raw, (NotDownloaded, InvalidRow)):  # an img2dataset shard's metadata rows
                yield raw
                continue
            line, offset, record, error = raw
            if position is not None and (at := position(src, offset)) is not None:
                reading.done = base + min(max(at - a, 0), room)
            yield src.fmt.row(src.path, line, offset, record, error, keys)
            count += 1
            if by_rows:
                reading.done = count
            if count == cfg.limit:
                return
        if not by_rows:
            reading.done = base + room


def _space(sources: list[Source], task_index: int, task_count: int) -> tuple[int, int, int]:
    """This task's range [lo, hi) of the byte space, and the space's size."""
    total = sources[-1].start + sources[-1].size if sources else 0
    return total * task_index // task_count, total * (task_index + 1) // task_count, total


def _part(src: Source, space: tuple[int, int, int], pick: tuple[int, int]) -> Part | None:
    """The part of one source this task reads (None: none of it): its byte range of a text or
    Parquet manifest, every k-th part of a spread one, or a whole source."""
    lo, hi, total = space
    if src.fmt.slicing == SPREAD:
        return Part(pick=pick)
    if src.fmt.taken_whole(src):  # by the task whose range holds its first byte (the last: one at the end)
        last = pick[0] == pick[1] - 1 and src.start == total
        return Part() if lo <= src.start < hi or last else None
    a, b = max(lo - src.start, 0), min(hi - src.start, src.size)
    return Part(a, b) if a < b else None


def _room(src: Source, part: Part) -> int | None:
    """The bytes of the byte space a part takes; of a spread source, which takes none there, the
    bytes its format says a task passes through (None: unknown)."""
    if part.pick is not None:
        return src.fmt.spread_room(src)
    return src.size if part.b is None else part.b - part.a
