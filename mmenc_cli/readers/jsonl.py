"""JSON lines manifests (`.jsonl`, `.ndjson`, and gzip-compressed): one JSON object a line."""

from __future__ import annotations

import json
import zlib
from typing import Any, Iterator

from ..errors import ManifestError, MMError
from .lines import BOM, Raw, open_text, read_line, row_too_large, sync
from .validate import kind


def decode_json(raw: bytes) -> tuple[dict[str, Any] | None, MMError | None]:
    """One JSONL line as a JSON object, or the read error."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError; absurd nesting
        return None, MMError(f"invalid JSON: {exc}", stage="read", reason="manifest.invalid_json",
                             error=type(exc).__name__)
    if not isinstance(value, dict):
        return None, MMError(f"line is {kind(value)}, not a JSON object", stage="read",
                             reason="manifest.invalid_json")
    return value, None


def jsonl_records(path: str, a: int, b: int | None, limit: int,
                  pick: tuple[int, int] | None = None) -> Iterator[Raw]:
    """JSON lines starting in [a, b) (b None: to the end); `pick` = (i, k) keeps rows n % k == i.
    A line over `limit` bytes is read past and yields a `manifest.row_too_large` error."""
    with open_text(path) as fh:
        pos, line = sync(fh, a)
        n = -1
        while b is None or pos < b:
            try:
                raw, size = read_line(fh, limit)
            except (OSError, EOFError, zlib.error) as exc:  # a truncated or corrupt .gz
                raise ManifestError(f"cannot read manifest {path}: {exc}") from None
            if not size:
                break
            start, pos = pos, pos + size
            here, line = line, None if line is None else line + 1
            if raw is None:
                n += 1
                if pick is None or n % pick[1] == pick[0]:
                    yield here, start, None, row_too_large(size, limit)
                continue
            if start == 0 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            if not raw.strip():
                continue
            n += 1
            if pick is not None and n % pick[1] != pick[0]:
                continue
            record, error = decode_json(raw)
            yield here, start, record, error
