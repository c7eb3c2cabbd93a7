"""Byte positions in text manifests: line starts, BOMs and the record tuple every format yields."""

from __future__ import annotations

import gzip
from typing import IO, Any

from ..errors import ManifestError, MMError

__all__ = ["BOM", "COUNT_LINES_UP_TO", "Raw", "check_line_start", "is_gzip", "open_text", "read_line", "row_too_large",
           "skip_line", "sync"]

BOM = b"\xef\xbb\xbf"


COUNT_LINES_UP_TO = 64 << 20  # newlines are counted before a task's start only below this
_CHUNK = 1 << 20  # an oversized line is read past in pieces of this size, never held whole


#: (line, offset, record, error): what a format reader yields for one record.
Raw = tuple[int | None, int, dict[str, Any] | None, MMError | None]


def is_gzip(path: str) -> bool:
    """Whether a text manifest is gzip-compressed (read as a stream, never seeked)."""
    return path.lower().endswith(".gz")


def open_text(path: str) -> IO[bytes]:
    """A binary handle on a text manifest (a local path or a URL), decompressing .gz."""
    from . import files

    fh = files.open_binary(path)
    return gzip.GzipFile(fileobj=fh, mode="rb") if is_gzip(path) else fh


def read_line(fh: IO[bytes], limit: int) -> tuple[bytes | None, int]:
    """The next line, its newline included, and its size; a line of more than `limit` bytes is
    read past in pieces and returned as None (with its size). (b"", 0) at the end of the file."""
    raw = fh.readline(limit + 1)
    if len(raw) <= limit:
        return raw, len(raw)
    return None, len(raw) + skip_line(fh)


def skip_line(fh: IO[bytes]) -> int:
    """Read past the rest of the current line (its newline included) in pieces; return its size."""
    size = 0
    while True:
        chunk = fh.readline(_CHUNK)
        size += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return size


def row_too_large(size: int, limit: int) -> MMError:
    """The error of a manifest line (or CSV record) over --max-row-bytes."""
    return MMError(f"the row is {size} bytes or more, over --max-row-bytes {limit}; it was read past, "
                   "not loaded", stage="read", reason="manifest.row_too_large")


def sync(fh: IO[bytes], a: int) -> tuple[int, int | None]:
    """Move to the first line start at or after byte `a`; return it and its line number if cheap."""
    if a == 0:
        fh.seek(0)
        return 0, 1
    fh.seek(a - 1)
    skip_line(fh)  # just the newline when byte a-1 is one, so a line starting at a is kept
    pos = fh.tell()
    if pos > COUNT_LINES_UP_TO:
        return pos, None
    fh.seek(0)
    newlines, left = 0, pos
    while left:
        chunk = fh.read(min(left, 1 << 20))
        newlines, left = newlines + chunk.count(b"\n"), left - len(chunk)
    return pos, newlines + 1


def check_line_start(fh: IO[bytes], path: str, offset: int) -> None:
    """Seek to `offset`, refusing one that is not a line start (the manifest changed since)."""
    if offset > 0:
        fh.seek(offset - 1)
        if fh.read(1) != b"\n":
            raise ManifestError(f"offset {offset} of {path} is not the start of a line: "
                                "has the manifest changed since the run?")
    fh.seek(offset)
