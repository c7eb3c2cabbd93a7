"""Reading manifests (JSONL, CSV/TSV, Parquet) as a stream of rows, split between tasks.

Formats are chosen by extension (`detect_format`): ``.jsonl``/``.ndjson`` (one JSON object a
line), ``.jsonl.gz``/``.ndjson.gz``, ``.csv``, ``.tsv`` (a header line, then one record per row)
and ``.parquet``. Nothing is ever loaded whole: text files are read line by line in binary, so a
row's ``offset`` is the exact byte offset of its first byte (the uncompressed offset for ``.gz``);
Parquet is read by row group with `iter_batches` and only the columns a row needs, and its
``offset`` is the row index in the file. ``line`` is the 1-based physical line where a record
starts (None for Parquet). A UTF-8 BOM at the start of a text manifest is ignored; CRLF is fine.
In CSV/TSV an empty cell is null (CSV has no other way to write one).

A row that cannot be used becomes an `InvalidRow` carrying an `MMError` (``manifest.*`` reasons);
only run-level problems raise `ManifestError`: a missing file, an unknown extension, an unreadable
Parquet file, a CSV header or Parquet schema without the id column (or without both the image and
the text column), or a CSV split that cannot be made safely (`slicing.py`).

Which rows each task of an array reads: `slicing.py`.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

from ..config import DEFAULT_MAX_ROW_BYTES, ManifestConfig
from ..errors import ManifestError, MMError
from ..records import InvalidRow, ManifestRow
from .delimited import csv_header, csv_parse, csv_record, open_csv
from .formats import detect_format
from .jsonl import decode_json
from .lines import BOM, check_line_start, open_text, read_line, row_too_large
from .parquet import parquet_record
from .slicing import iter_slice, plan
from .validate import to_row

__all__ = ["ManifestError", "detect_format", "iter_rows", "read_raw_row", "read_row"]


def iter_rows(manifests: Sequence[str], cfg: ManifestConfig, task_index: int = 0,
              task_count: int = 1) -> Iterator[ManifestRow | InvalidRow]:
    """Stream the rows of this task's slice of `manifests` (see the module docstring).

    Files are checked (exist, known format) before the first row, so a bad path fails at once.
    """
    if task_count < 1 or not 0 <= task_index < task_count:
        raise ManifestError(f"task index {task_index} is not in [0, {task_count})")
    sources = plan(manifests)
    return iter_slice(sources, cfg, task_index, task_count)


def read_raw_row(manifest: str, offset: int) -> dict[str, Any]:
    """The record at `offset` as iter_rows saw it (a JSON object, a CSV dict, a Parquet row).

    `offset` is a ManifestRow's offset: a byte offset (JSONL, CSV) or a row index (Parquet).
    Used by `mmenc errors retry` to rebuild failed rows. Raises ManifestError when the offset does
    not point at a record (the manifest changed?) or the record is unreadable.
    """
    record, error = read_record(os.path.abspath(manifest), offset)
    if error is not None:
        raise ManifestError(f"{manifest} at offset {offset}: {error.message}")
    return record


def read_row(manifest: str, offset: int, cfg: ManifestConfig,
             line: int | None = None) -> ManifestRow | InvalidRow:
    """The row at `offset`, validated exactly as iter_rows does (an unreadable record is an
    InvalidRow); `line` is passed through since it is not known from the offset alone."""
    path = os.path.abspath(manifest)
    record, error = read_record(path, offset)
    return to_row(path, line, offset, record, error, cfg)


def read_record(path: str, offset: int,
                limit: int = DEFAULT_MAX_ROW_BYTES) -> tuple[dict[str, Any] | None, MMError | None]:
    """The record at `offset` and its read error (a record over `limit` bytes is not loaded);
    ManifestError when there is no record there."""
    fmt = detect_format(path)
    if not os.path.isfile(path):
        raise ManifestError(f"manifest not found: {path}")
    if offset < 0:
        raise ManifestError(f"offset {offset} is negative")
    if fmt == "parquet":
        return parquet_record(path, offset), None
    with open_text(path) as fh:
        if fmt == "jsonl.gz" or fmt == "jsonl":
            check_line_start(fh, path, offset)
            raw, size = read_line(fh, limit)
            if raw is None:
                return None, row_too_large(size, limit)
            if offset == 0 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            if not raw.strip():
                raise ManifestError(f"no record at offset {offset} of {path}")
            return decode_json(raw)
        feed, reader = open_csv(fh, fmt, limit)
        header = csv_header(reader, path, None)
        if header is None or offset < feed.pos:
            raise ManifestError(f"offset {offset} of {path} is not a CSV row (header or empty file)")
        check_line_start(fh, path, offset)
        feed.seek(offset, None)
        for _, _, fields, error in csv_parse(reader, feed, offset + 1):
            return csv_record(header, fields, error, feed)
        raise ManifestError(f"no record at offset {offset} of {path}")
