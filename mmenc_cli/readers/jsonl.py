"""JSON lines manifests (`.jsonl`, `.ndjson`, and gzip-compressed): one JSON object a line.

Task slices: a plain file by byte ranges (a record belongs to the task whose range holds its first
byte); a `.gz` file, which cannot be seeked, by every k-th non-blank line. `offset` is the byte
offset of the line's first byte (uncompressed for `.gz`), what `mmenc errors retry` rereads.
"""

from __future__ import annotations

import functools
import json
import os
import zlib
from typing import Any, Iterator

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from ..records import InvalidRow, ManifestRow
from .lines import BOM, Raw, check_line_start, open_text, read_line, row_too_large, sync
from .registry import RANGES, SPREAD, Format, Part, Source, register
from .validate import Keys, kind, to_row


def decode_json(raw: bytes) -> tuple[dict[str, Any] | None, MMError | None]:
    """One JSONL line as a JSON object, or the read error."""
    try:
        # json.loads decodes bytes as UTF-8 unless their first bytes say UTF-16 or -32 (a BOM, or
        # a NUL in the first two): decoded here the same way, without its detection per line
        plain = raw[:1] not in _NOT_PLAIN and raw[1:2] != b"\x00"
        value = json.loads(raw.decode("utf-8", "surrogatepass") if plain else raw)
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError; absurd nesting
        return None, MMError(f"invalid JSON: {exc}", stage="read", reason="manifest.invalid_json",
                             error=type(exc).__name__)
    if not isinstance(value, dict):
        return None, MMError(f"line is {kind(value)}, not a JSON object", stage="read",
                             reason="manifest.invalid_json")
    return value, None


_NOT_PLAIN = (b"", b"\x00", b"\xef", b"\xfe", b"\xff")  # what json's encoding detection looks at


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


def jsonl_line(path: str, offset: int, limit: int) -> tuple[dict[str, Any] | None, MMError | None]:
    """The JSON line starting at byte `offset` (for `mmenc errors retry`)."""
    with open_text(path) as fh:
        check_line_start(fh, path, offset)
        raw, size = read_line(fh, limit)
        if raw is None:
            return None, row_too_large(size, limit)
        if offset == 0 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if not raw.strip():
            raise ManifestError(f"no record at offset {offset} of {path}")
        return decode_json(raw)


def text_row(path: str, line: int | None, offset: int, record: dict[str, Any], keys: Keys,
             base_dir: str) -> ManifestRow | None:
    """The row of a plain text record (an id that is a non-blank string, a text string that is
    valid Unicode, no medium, no kept field), as `validate.to_row` makes it; None for any other
    record, which `to_row` validates. A text manifest's rows are mostly these."""
    row_id, text = record.get(keys.id), record.get(keys.text)
    if type(row_id) is not str or type(text) is not str or keys.keep or not row_id.strip():
        return None
    if not (row_id.isascii() and text.isascii()) and not (_utf8(row_id) and _utf8(text)):
        return None
    for k in _media_keys(keys):
        if record.get(k) is not None:
            return None
    return ManifestRow(id=row_id, manifest=path, line=line, offset=offset, text=text, keep={}, base_dir=base_dir)


@functools.lru_cache(maxsize=16)
def _media_keys(keys: Keys) -> tuple[str, ...]:
    return keys.image + keys.audio + keys.video


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: `to_row` says which key
        return False
    return True


@functools.lru_cache(maxsize=64)
def _dirname(path: str) -> str:
    return os.path.dirname(path)


class Jsonl(Format):
    """`.jsonl`/`.ndjson`: read by byte ranges."""

    name, extensions, slicing = "jsonl", (".jsonl", ".ndjson"), RANGES

    def row(self, path: str, line: int | None, offset: int, record: dict[str, Any] | None,
            error: MMError | None, keys: Keys) -> ManifestRow | InvalidRow:
        """One record validated into a row: plain text rows by `text_row`, the rest by `to_row`."""
        base_dir = self.base_dir(path)
        if error is None and record is not None and not self.keyed and (
                row := text_row(path, line, offset, record, keys, base_dir)):
            return row
        return to_row(path, line, offset, record, error, keys, base_dir, self.key_of(record))

    def base_dir(self, path: str) -> str:
        """The manifest's folder (asked once a row: remembered)."""
        return _dirname(path)

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Raw]:
        """The lines starting in the task's byte range."""
        return jsonl_records(src.path, part.a, part.b, cfg.max_row_bytes)

    def position(self, src: Source, offset: int) -> int | None:
        """The line's byte offset (a `.gz` file takes no room: never asked)."""
        return offset

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """The line at byte `offset`."""
        return jsonl_line(path, offset, limit)


class JsonlGz(Jsonl):
    """`.jsonl.gz`/`.ndjson.gz`: decompressed by every task, every k-th line kept."""

    name, extensions, slicing = "jsonl.gz", (".jsonl.gz", ".ndjson.gz"), SPREAD

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Raw]:
        """The task's every k-th non-blank line."""
        return jsonl_records(src.path, 0, None, cfg.max_row_bytes, pick=part.pick)


JSONL = register(Jsonl())
JSONL_GZ = register(JsonlGz())
