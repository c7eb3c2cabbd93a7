"""Reading inputs as a stream of rows, split between tasks: manifests (JSONL, CSV/TSV, Parquet,
Arrow), WebDataset tar shards, folders of files, saved datasets and img2dataset outputs, local or
behind an fsspec URL.

Manifest formats are chosen by extension (`detect_format`): ``.jsonl``/``.ndjson`` (one JSON
object a line), ``.jsonl.gz``/``.ndjson.gz``, ``.csv``, ``.tsv`` (a header line, then one record per
row), ``.parquet``, ``.arrow``; ``.tar`` is a WebDataset shard (`tar.py`); a folder is a folder of
files (`folder.py`), a saved dataset (`arrow.py`) or an img2dataset output (`img2dataset.py`).
Globs and brace ranges are expanded here (`files.py`), so they work quoted. Nothing is ever loaded whole: text files are read line by line in binary, so a
row's ``offset`` is the exact byte offset of its first byte (the uncompressed offset for ``.gz``);
Parquet is read by row group with `iter_batches` and only the columns a row needs, and its
``offset`` is the row index in the file. ``line`` is the 1-based physical line where a record
starts (None for Parquet). A UTF-8 BOM at the start of a text manifest is ignored; CRLF is fine.
In CSV/TSV an empty cell is null (CSV has no other way to write one), but in the text column an
empty text, as `""` is in JSONL and Parquet (422 `text.empty` when encoded).

A row that cannot be used becomes an `InvalidRow` carrying an `MMError` (``manifest.*`` reasons),
and so does a damaged part of a Parquet or Arrow file (`batches.py`); only run-level problems raise
`ManifestError`: a missing file, an unknown extension, a CSV header or Parquet schema without the
id column (or without both the image and the text column), a saved dataset's listing that is not
JSON, or a CSV split that cannot be made safely (`slicing.py`).

Which rows each task of an array reads: `slicing.py`. Each format is one `registry.Format`
object, registered by its module (imported here), that planning, slicing, rereading and the error
report's retry ask: a new format is a module with one, not a change to those.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from ..config import DEFAULT_MAX_ROW_BYTES, ManifestConfig
from ..errors import ManifestError
from ..records import InvalidRow, ManifestRow, NotDownloaded
# importing the format modules registers the built-in formats
from . import arrow, delimited, folder, img2dataset, jsonl, missing, parquet, tar  # noqa: F401
from .files import expand, is_url, local
from .plan import plan
from .preflight import preflight
from .registry import Format, Source, by_extension, format_of, register
from .reread import read_record
from .slicing import Reading, iter_slice, work_size

__all__ = ["Format", "ManifestError", "Reading", "detect_format", "expand", "format_of", "is_url", "iter_rows",
           "preflight", "read_raw_row", "read_row", "record_has_id", "register", "slice_size", "source_format"]


def iter_rows(manifests: Sequence[str], cfg: ManifestConfig, task_index: int = 0, task_count: int = 1,
              reading: Reading | None = None, sources: list[Source] | None = None
              ) -> Iterator[ManifestRow | InvalidRow | NotDownloaded]:
    """Stream the rows of this task's slice of the inputs (see the module docstring); `reading`,
    where given, gets the slice's size at once and follows the position reached (progress);
    `sources`: the inputs planned already (`preflight`).

    Inputs are checked (exist, known format) before the first row, so a bad path fails at once.
    """
    if task_count < 1 or not 0 <= task_index < task_count:
        raise ManifestError(f"task index {task_index} is not in [0, {task_count})")
    sources = plan(manifests) if sources is None else sources
    if reading is not None:
        size = work_size(sources, cfg, task_index, task_count)
        reading.total, reading.unit, reading.done = size.total, size.unit, 0
    return iter_slice(sources, cfg, task_index, task_count, reading)


def slice_size(manifests: Sequence[str], cfg: ManifestConfig, task_index: int = 0, task_count: int = 1) -> Reading:
    """The size of a task's slice without reading it (sizes from a stat or a listing; `Reading`)."""
    return work_size(plan(manifests), cfg, task_index, task_count)


def read_raw_row(manifest: str, offset: int, key: str | None = None,
                 limit: int = DEFAULT_MAX_ROW_BYTES) -> dict[str, Any]:
    """The record at `offset` as iter_rows saw it (a JSON object, a CSV dict, a Parquet or Arrow
    row, a tar sample; a folder's sample by its `key`, the relative path, with its .txt and
    .json): what `mmenc errors retry` rebuilds a failed row from. ManifestError when the offset
    does not point at a record (the input changed?) or the record is unreadable."""
    record, error = read_record(local(manifest), offset, limit, key)
    if error is not None:
        raise ManifestError(f"{manifest} at offset {offset}: {error.message}")
    assert record is not None
    return record


def detect_format(path: str) -> str:
    """The name of a file's format from its extension ("jsonl", "jsonl.gz", "csv", "tsv",
    "parquet", "tar", "arrow", or a registered format's); ManifestError when none has it."""
    return by_extension(path).name


def source_format(path: str) -> str:
    """The name of the format of the source an error row names (see `registry.format_of`)."""
    return format_of(path).name


def read_row(manifest: str, offset: int, cfg: ManifestConfig, line: int | None = None,
             key: str | None = None) -> ManifestRow | InvalidRow:
    """The row at `offset` (a folder's: `key`), validated exactly as iter_rows does (an unreadable
    record is an InvalidRow); `line` is passed through since it is not known from the offset alone."""
    path = local(manifest)
    fmt = format_of(path)
    record, error = read_record(path, offset, cfg.max_row_bytes, key)
    return fmt.row(path, line, offset, record, error, fmt.keys(cfg))


def record_has_id(manifest: str, offset: int, row_id: str, cfg: ManifestConfig) -> bool:
    """Whether the record at `offset` of `manifest` still has id `row_id` (False when the input is
    gone or changed there): how a resume tells a second row of an id from a row that moved."""
    try:
        return read_row(manifest, offset, cfg).id == row_id
    except (ManifestError, OSError, ValueError):
        return False
