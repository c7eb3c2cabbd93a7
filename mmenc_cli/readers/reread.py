"""Rereading one record of an input, as `mmenc errors retry` needs it: by the `offset` (and, for a
format whose records are found by key, the key) an error row recorded; its format says how."""

from __future__ import annotations

from typing import Any

from ..config import DEFAULT_MAX_ROW_BYTES
from ..errors import ManifestError, MMError
from .registry import format_of


def read_record(path: str, offset: int, limit: int = DEFAULT_MAX_ROW_BYTES,
                key: str | None = None) -> tuple[dict[str, Any] | None, MMError | None]:
    """The record at `offset` of the source at `path` (a keyed format's: at `key`; without one,
    the `offset`-th record) and its read error (a record over `limit` bytes is not loaded);
    ManifestError when there is none."""
    fmt = format_of(path)
    if offset < 0:
        raise ManifestError(f"offset {offset} is negative")
    return fmt.record(path, offset, limit, key)
