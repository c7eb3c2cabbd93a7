"""CSV and TSV manifests: a header line, then one record per row (quoted fields may span lines)."""

from __future__ import annotations

import csv
from typing import IO, Any, Iterator

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from .formats import Source
from .lines import BOM, Raw, sync
from .validate import check_columns


class LineFeed:
    """Decoded lines for csv.reader, remembering where the next line starts and how many lines the
    current record used (the reader pulls exactly the lines a record needs, never more)."""

    def __init__(self, fh: IO[bytes], pos: int, line: int | None) -> None:
        self.fh, self.pos, self.line = fh, pos, line
        self.used, self.bad_utf8 = 0, False

    def __iter__(self) -> "LineFeed":
        return self

    def __next__(self) -> str:
        raw = self.fh.readline()
        if not raw:
            raise StopIteration
        bom = len(BOM) if self.pos == 0 and raw.startswith(BOM) else 0
        self.pos += len(raw)
        self.used += 1
        if self.line is not None:
            self.line += 1
        try:
            return raw[bom:].decode("utf-8")
        except UnicodeDecodeError:  # reported as an invalid row once the reader has the record
            self.bad_utf8 = True
            return raw[bom:].decode("utf-8", "replace")

    def start_record(self) -> None:
        """Reset the per-record counters before asking the reader for the next record."""
        self.used, self.bad_utf8 = 0, False

    def seek(self, pos: int, line: int | None) -> None:
        """Continue from another line start (the reader is between records)."""
        self.fh.seek(pos)
        self.pos, self.line = pos, line


def csv_header(reader: Any, path: str, cfg: ManifestConfig | None) -> list[str] | None:
    """The header's column names (None for an empty file); checks the id/image/text columns."""
    try:
        header = next((fields for fields in reader if fields), None)
    except csv.Error as exc:
        raise ManifestError(f"cannot read the CSV header of {path}: {exc}") from None
    if header is None:
        return None
    header = [name.strip() for name in header]
    if cfg is not None:
        check_columns(header, path, cfg)
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
        except csv.Error as exc:  # the reader resumes at the next line
            yield start, line, None, MMError(f"bad CSV record: {exc}", stage="read",
                                             reason="manifest.invalid_row", error="csv.Error")
            continue
        if fields:
            yield start, line, fields, None


def csv_record(header: list[str], fields: list[str] | None, error: MMError | None,
               feed: LineFeed) -> tuple[dict[str, Any] | None, MMError | None]:
    """A CSV record as a dict (an empty cell is null), or why it is not a row."""
    if error is not None:
        return None, error
    record = {name: value or None for name, value in zip(header, fields or ())}
    if feed.bad_utf8:
        return record, MMError("the CSV record is not valid UTF-8", stage="read",
                               reason="manifest.invalid_row", error="UnicodeDecodeError")
    if len(fields or ()) != len(header):
        return record, MMError(f"the CSV row has {len(fields or ())} fields, the header has "
                               f"{len(header)}", stage="read", reason="manifest.invalid_row")
    return record, None


def csv_records(src: Source, cfg: ManifestConfig, a: int, b: int, multiline: bool) -> Iterator[Raw]:
    """CSV/TSV records starting in [a, b), by seeking (default) or by parsing from the top."""
    with open(src.path, "rb") as fh:
        feed = LineFeed(fh, 0, 1)
        reader = csv.reader(feed, delimiter="\t" if src.fmt == "tsv" else ",")
        header = csv_header(reader, src.path, cfg)
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
            record, error = csv_record(header, fields, error, feed)
            yield line, start, record, error
