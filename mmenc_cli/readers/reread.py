"""Rereading one record of an input, as `mmenc errors retry` needs it: by the `offset` (and, for a
folder, the id) an error row recorded."""

from __future__ import annotations

import posixpath
from typing import Any

from ..config import DEFAULT_MAX_ROW_BYTES
from ..errors import ManifestError, MMError
from . import files
from .arrow import arrow_record
from .delimited import csv_header, csv_parse, csv_record, open_csv
from .folder import sample, walk
from .formats import detect_format
from .jsonl import decode_json
from .lines import BOM, check_line_start, open_text, read_line, row_too_large
from .parquet import parquet_record
from .tar import read_sample

_STATS = "_stats.json"


def source_format(path: str) -> str:
    """The format of the source an error row names: a file's by extension; a folder ("folder", or
    "i2d-files" inside an img2dataset output); a Parquet shard of an img2dataset output ("i2d-parquet")."""
    found = files.info(path)
    if not found.exists:
        raise ManifestError(f"manifest not found: {path}")
    parent, name = posixpath.split(path.rstrip("/")) if files.is_url(path) else _split_local(path)
    stem = name.split(".", 1)[0]
    beside = files.info(files.join(parent, stem + _STATS)).exists
    if found.is_dir:
        return "i2d-files" if beside else "folder"
    fmt = detect_format(path)
    return "i2d-parquet" if fmt == "parquet" and beside else fmt


def _split_local(path: str) -> tuple[str, str]:
    import os

    return os.path.split(os.path.normpath(path))


def read_record(path: str, offset: int, limit: int = DEFAULT_MAX_ROW_BYTES,
                key: str | None = None) -> tuple[dict[str, Any] | None, MMError | None]:
    """The record at `offset` (for a folder: the sample `key`, its relative path; without one the
    `offset`-th sample of the walk) and its read error (a record over `limit` bytes is not
    loaded); ManifestError when there is none."""
    fmt = source_format(path)
    if offset < 0:
        raise ManifestError(f"offset {offset} is negative")
    if fmt in ("parquet", "i2d-parquet"):
        return parquet_record(path, offset), None
    if fmt == "arrow":
        return arrow_record(path, offset), None
    if fmt == "tar":
        return read_sample(path, offset, limit)
    if fmt in ("folder", "i2d-files"):
        return _folder_record(path, offset, key, limit)
    return _text_record(path, fmt, offset, limit)


def _folder_record(root: str, offset: int, rel: str | None, limit: int) -> tuple[dict[str, Any] | None, MMError | None]:
    """A folder's sample by its relative path (its place in the walk moves as files come and go;
    only a row written before samples had keys is found by it)."""
    if rel is not None:
        if not files.info(files.join(root, *rel.split("/"))).exists:
            raise ManifestError(f"{root} has no file {rel} any more: has the folder changed since the run?")
        return sample(root, rel, limit)
    for n, (first, found) in enumerate(walk(root)):
        if n == offset:
            return sample(root, first, limit, found)
    raise ManifestError(f"{root} has no sample number {offset}: has the folder changed since the run?")


def _text_record(path: str, fmt: str, offset: int, limit: int) -> tuple[dict[str, Any] | None, MMError | None]:
    """A JSONL line or CSV record at its byte offset."""
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
