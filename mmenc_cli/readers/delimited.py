"""CSV and TSV manifests: a header line, then one record per row (quoted fields may span lines).

Task slices: byte ranges (`slicing.py` says how a record spanning lines is handled); `offset`
is the byte offset of the record's first byte, what `mmenc errors retry` rereads.
"""

from __future__ import annotations

import csv
from typing import IO, Any, Iterator

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from . import files
from .lines import BOM, Raw, check_line_start, open_text, row_too_large, sync
from .registry import RANGES, Format, Part, Source, register
from .validate import Keys, check_columns


class QuoteState:
    """Whether a CSV record is still open (inside a quoted field) after the bytes seen so far, by
    the csv module's own rules: a quote opens a quoted field only at a field's start, `""` inside
    one is a quote, a newline inside one belongs to the field. Fast on long lines (`bytes.find`)."""

    OUT_START, OUT_FIELD, IN_QUOTES, QUOTE = range(4)

    def __init__(self, delimiter: bytes) -> None:
        self.delimiter = delimiter
        self.state = self.OUT_START

    @property
    def open(self) -> bool:
        """Inside a quoted field: the record goes on past the end of this line."""
        return self.state == self.IN_QUOTES

    def feed(self, data: bytes) -> None:
        """Advance over `data` (any piece of the file, split anywhere)."""
        pos, n = 0, len(data)
        while pos < n:
            if self.state == self.IN_QUOTES:
                j = data.find(b'"', pos)
                if j < 0:
                    return
                self.state, pos = self.QUOTE, j + 1
            elif self.state == self.QUOTE:
                c = data[pos:pos + 1]
                self.state = (self.IN_QUOTES if c == b'"' else self.OUT_START if c in (self.delimiter, b"\n", b"\r")
                              else self.OUT_FIELD)
                pos += 1
            else:
                pos = self._outside(data, pos)

    def _outside(self, data: bytes, pos: int) -> int:
        """Outside quotes: skip to the next quote; it opens a quoted field only at a field's start."""
        j = data.find(b'"', pos)
        end = len(data) if j < 0 else j
        if end > pos:  # bytes before the quote (or to the end): where do they leave us?
            last = data[end - 1:end]
            self.state = self.OUT_START if last in (self.delimiter, b"\n", b"\r") else self.OUT_FIELD
        if j < 0:
            return len(data)
        self.state = self.IN_QUOTES if self.state == self.OUT_START else self.OUT_FIELD
        return j + 1


class RecordTooLarge(Exception):
    """The CSV record being read passed --max-row-bytes; its lines have been read past."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class LineFeed:
    """Decoded lines for csv.reader, remembering where the next line starts, how many lines and
    bytes the current record used (the reader pulls exactly the lines a record needs) and whether
    it is still open. A record over `limit` bytes is read past in pieces (`RecordTooLarge`)."""

    def __init__(self, fh: IO[bytes], pos: int, line: int | None, delimiter: str = ",",
                 limit: int = 1 << 62) -> None:
        self.fh, self.pos, self.line, self.limit = fh, pos, line, limit
        self.quotes = QuoteState(delimiter.encode())
        self.used, self.size, self.bad_utf8 = 0, 0, False

    def __iter__(self) -> "LineFeed":
        return self

    def __next__(self) -> str:
        raw = self.fh.readline(self.limit - self.size + 1)
        if not raw:
            raise StopIteration
        self._advance(raw)
        if self.size > self.limit:
            if not raw.endswith(b"\n") or self.quotes.open:
                self.skip_record()
            raise RecordTooLarge(self.size)
        bom = len(BOM) if self.pos == len(raw) and raw.startswith(BOM) else 0
        try:
            return raw[bom:].decode("utf-8")
        except UnicodeDecodeError:  # reported as an invalid row once the reader has the record
            self.bad_utf8 = True
            return raw[bom:].decode("utf-8", "replace")

    def _advance(self, raw: bytes) -> None:
        self.quotes.feed(raw)
        self.pos += len(raw)
        self.size += len(raw)
        if raw.endswith(b"\n"):
            self.used += 1
            if self.line is not None:
                self.line += 1

    def skip_record(self) -> None:
        """Read past the rest of the current record (the rest of its line, and its lines while a
        quoted field is open), in pieces, keeping nothing."""
        while True:
            chunk = self.fh.readline(1 << 20)
            if not chunk:
                return
            self._advance(chunk)
            if chunk.endswith(b"\n") and not self.quotes.open:
                return

    def start_record(self) -> None:
        """Reset the per-record counters before asking the reader for the next record."""
        self.used, self.size, self.bad_utf8 = 0, 0, False
        self.quotes.state = QuoteState.OUT_START

    def seek(self, pos: int, line: int | None) -> None:
        """Continue from another line start (the reader is between records)."""
        self.fh.seek(pos)
        self.pos, self.line = pos, line


def open_csv(fh: IO[bytes], delimiter: str, limit: int) -> tuple[LineFeed, Any]:
    """A line feed and a csv reader over it (the csv module's own field limit raised to `limit`,
    which the feed enforces per record in bytes)."""
    if csv.field_size_limit() < limit:
        csv.field_size_limit(limit)
    feed = LineFeed(fh, 0, 1, delimiter, limit)
    return feed, csv.reader(feed, delimiter=delimiter)


def csv_header(reader: Any, path: str, keys: Keys | None) -> list[str] | None:
    """The header's column names (None for an empty file); checks the id/image/text columns."""
    try:
        header = next((fields for fields in reader if fields), None)
    except csv.Error as exc:
        raise ManifestError(f"cannot read the CSV header of {path}: {exc}") from None
    if header is None:
        return None
    header = [name.strip() for name in header]
    if keys is not None:
        check_columns(header, path, keys)
    return header


def csv_parse(reader: Any, feed: LineFeed,
              end: int) -> Iterator[tuple[int, int | None, list[str] | None, MMError | None]]:
    """(start, line, fields, error) for each non-blank record starting before byte `end`. The
    feed's counters describe the record just yielded until the generator is resumed."""
    while feed.pos < end:
        start, line = feed.pos, feed.line
        feed.start_record()
        try:
            fields = next(reader)
        except StopIteration:
            return
        except RecordTooLarge as exc:
            yield start, line, None, row_too_large(exc.size, feed.limit)
            continue
        except csv.Error as exc:  # the reader starts afresh at the next line: skip the rest of the record
            if feed.quotes.open:
                feed.skip_record()
            yield start, line, None, MMError(f"bad CSV record: {exc}", stage="read",
                                             reason="manifest.invalid_row", error="csv.Error")
            continue
        if fields:
            yield start, line, fields, None


def csv_record(header: list[str], fields: list[str] | None, error: MMError | None,
               feed: LineFeed, text: str | None = None) -> tuple[dict[str, Any] | None, MMError | None]:
    """A CSV record as a dict (an empty cell is null, but in the `text` column an empty text, as
    `""` is in JSONL or Parquet: 422 text.empty), or why it is not a row."""
    if error is not None:
        return None, error
    record = {name: value if value or name == text else None for name, value in zip(header, fields or ())}
    if feed.bad_utf8:
        return record, MMError("the CSV record is not valid UTF-8", stage="read",
                               reason="manifest.invalid_row", error="UnicodeDecodeError")
    if len(fields or ()) != len(header):
        return record, MMError(f"the CSV row has {len(fields or ())} fields, the header has "
                               f"{len(header)}", stage="read", reason="manifest.invalid_row")
    return record, None


def csv_records(src: Source, keys: Keys, cfg: ManifestConfig, span: tuple[int, int], delimiter: str) -> Iterator[Raw]:
    """CSV/TSV records starting in `span` = [a, b), by seeking (default) or by parsing from the top
    (`cfg.csv_multiline`)."""
    (a, b), multiline = span, cfg.csv_multiline
    with files.open_binary(src.path) as fh:
        feed, reader = open_csv(fh, delimiter, cfg.max_row_bytes)
        header = csv_header(reader, src.path, keys)
        if header is None:
            return
        body = feed.pos
        shared = a > body or b < src.size
        if a > body and not multiline:
            feed.seek(*sync(fh, a))
        for start, line, fields, error in csv_parse(reader, feed, b):
            if start < a:  # csv_multiline: still parsing the prefix to find true record starts
                continue
            if feed.used > 1 and shared and not multiline:
                where = f"line {line}" if line is not None else f"byte {start}"
                raise ManifestError(
                    f"{src.path}: the CSV record at {where} has a quoted field spanning lines, so "
                    "this file cannot be split between tasks by byte ranges: enable csv_multiline "
                    "(--csv-multiline), run one task, or convert the manifest to JSONL/Parquet")
            record, error = csv_record(header, fields, error, feed, keys.text)
            yield line, start, record, error


def csv_row_at(path: str, delimiter: str, offset: int, limit: int) -> tuple[dict[str, Any] | None, MMError | None]:
    """The CSV/TSV record starting at byte `offset` (for `mmenc errors retry`)."""
    with open_text(path) as fh:
        feed, reader = open_csv(fh, delimiter, limit)
        header = csv_header(reader, path, None)
        if header is None or offset < feed.pos:
            raise ManifestError(f"offset {offset} of {path} is not a CSV row (header or empty file)")
        check_line_start(fh, path, offset)
        feed.seek(offset, None)
        for _, _, fields, error in csv_parse(reader, feed, offset + 1):
            return csv_record(header, fields, error, feed)
        raise ManifestError(f"no record at offset {offset} of {path}")


class Delimited(Format):
    """CSV (`.csv`) or TSV (`.tsv`): read by byte ranges, split at the `delimiter`."""

    slicing = RANGES

    def __init__(self, name: str, extension: str, delimiter: str) -> None:
        self.name, self.extensions, self.delimiter = name, (extension,), delimiter

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Raw]:
        """The records starting in the task's byte range."""
        assert part.b is not None
        return csv_records(src, self.keys(cfg), cfg, (part.a, part.b), self.delimiter)

    def position(self, src: Source, offset: int) -> int | None:
        """The record's byte offset."""
        return offset

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """The record at byte `offset`."""
        return csv_row_at(path, self.delimiter, offset, limit)


CSV = register(Delimited("csv", ".csv", ","))
TSV = register(Delimited("tsv", ".tsv", "\t"))
