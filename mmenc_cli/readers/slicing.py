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

import os
from typing import Iterator, Sequence

from ..config import ManifestConfig
from ..errors import ManifestError
from ..records import InvalidRow, ManifestRow
from .delimited import csv_records
from .formats import Source, detect_format
from .jsonl import jsonl_records
from .parquet import parquet_records
from .validate import to_row


def plan(manifests: Sequence[str]) -> list[Source]:
    """Check every manifest and lay them out in the virtual byte space."""
    sources, start = [], 0
    for given in manifests:
        fmt = detect_format(given)
        path = os.path.abspath(given)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ManifestError(f"manifest not found: {given}") from None
        except OSError as exc:
            raise ManifestError(f"cannot read manifest {given}: {exc}") from None
        if not os.path.isfile(path):
            raise ManifestError(f"manifest is not a file: {given}")
        size = 0 if fmt == "jsonl.gz" else st.st_size
        sources.append(Source(path, fmt, start, size))
        start += size
    return sources


def iter_slice(sources: list[Source], cfg: ManifestConfig, task_index: int,
               task_count: int) -> Iterator[ManifestRow | InvalidRow]:
    """Rows of every source within this task's byte range, up to cfg.limit."""
    if cfg.limit == 0:
        return
    total = sources[-1].start + sources[-1].size if sources else 0
    lo, hi = total * task_index // task_count, total * (task_index + 1) // task_count
    multiline = cfg.csv_multiline
    count = 0
    for src in sources:
        a, b = max(lo - src.start, 0), min(hi - src.start, src.size)
        if src.fmt == "jsonl.gz":
            raws = jsonl_records(src.path, 0, None, cfg.max_row_bytes, pick=(task_index, task_count))
        elif a >= b:
            continue
        elif src.fmt == "parquet":
            raws = parquet_records(src, cfg, a, b)
        elif src.fmt == "jsonl":
            raws = jsonl_records(src.path, a, b, cfg.max_row_bytes)
        else:
            raws = csv_records(src, cfg, a, b, multiline)
        for line, offset, record, error in raws:
            yield to_row(src.path, line, offset, record, error, cfg)
            count += 1
            if count == cfg.limit:
                return
