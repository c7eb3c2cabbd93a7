"""Reading manifests (JSONL, CSV/TSV, Parquet) as a stream of rows, and splitting them between tasks.

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
the text column), or a CSV split that cannot be made safely (below).

Task slicing (Slurm arrays: task i of k)
----------------------------------------
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

import csv
import gzip
import json
import os
import zlib
from dataclasses import dataclass
from typing import IO, Any, Iterator, Sequence

from .config import ManifestConfig
from .errors import MMError
from .records import InvalidRow, ManifestRow

_EXTENSIONS = (
    (".jsonl.gz", "jsonl.gz"), (".ndjson.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".ndjson", "jsonl"),
    (".csv", "csv"), (".tsv", "tsv"), (".parquet", "parquet"),
)
_BOM = b"\xef\xbb\xbf"
_COUNT_LINES_UP_TO = 64 << 20  # newlines are counted before a task's start only below this
_PARQUET_BATCH = 256  # rows converted to Python at once: inline images make rows large
_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          list: "an array", dict: "an object", bytes: "bytes", type(None): "null"}

#: (line, offset, record, error): what a format reader yields for one record.
_Raw = tuple[int | None, int, dict[str, Any] | None, MMError | None]


class ManifestError(ValueError):
    """A manifest that cannot be read at all: a run-level error, never one row's failure."""


@dataclass(frozen=True, slots=True)
class _Source:
    """One manifest and its place in the tasks' virtual byte space."""

    path: str  # absolute
    fmt: str
    start: int
    size: int  # bytes it occupies in the virtual space (0 for .gz)


def detect_format(path: str) -> str:
    """The manifest format from the file name: "jsonl", "jsonl.gz", "csv", "tsv" or "parquet"."""
    name = os.path.basename(path).lower()
    for ext, fmt in _EXTENSIONS:
        if name.endswith(ext):
            return fmt
    raise ManifestError(f"cannot tell the format of manifest {path!r} from its extension: "
                        "use .jsonl, .ndjson, .jsonl.gz, .csv, .tsv or .parquet")


def iter_rows(manifests: Sequence[str], cfg: ManifestConfig, task_index: int = 0,
              task_count: int = 1) -> Iterator[ManifestRow | InvalidRow]:
    """Stream the rows of this task's slice of `manifests` (see the module docstring).

    Files are checked (exist, known format) before the first row, so a bad path fails at once.
    """
    if task_count < 1 or not 0 <= task_index < task_count:
        raise ManifestError(f"task index {task_index} is not in [0, {task_count})")
    sources = _plan(manifests)
    return _iter_slice(sources, cfg, task_index, task_count)


def read_raw_row(manifest: str, offset: int) -> dict[str, Any]:
    """The record at `offset` as iter_rows saw it (a JSON object, a CSV dict, a Parquet row).

    `offset` is a ManifestRow's offset: a byte offset (JSONL, CSV) or a row index (Parquet).
    Used by `mmenc errors retry` to rebuild failed rows. Raises ManifestError when the offset does
    not point at a record (the manifest changed?) or the record is unreadable.
    """
    record, error = _read_record(os.path.abspath(manifest), offset)
    if error is not None:
        raise ManifestError(f"{manifest} at offset {offset}: {error.message}")
    return record


def read_row(manifest: str, offset: int, cfg: ManifestConfig,
             line: int | None = None) -> ManifestRow | InvalidRow:
    """The row at `offset`, validated exactly as iter_rows does (an unreadable record is an
    InvalidRow); `line` is passed through since it is not known from the offset alone."""
    path = os.path.abspath(manifest)
    record, error = _read_record(path, offset)
    return _to_row(path, line, offset, record, error, cfg)


# --------------------------------------------------------------------------------------------
# Planning and slicing


def _plan(manifests: Sequence[str]) -> list[_Source]:
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
        sources.append(_Source(path, fmt, start, size))
        start += size
    return sources


def _iter_slice(sources: list[_Source], cfg: ManifestConfig, task_index: int,
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
            raws = _jsonl_records(src.path, 0, None, pick=(task_index, task_count))
        elif a >= b:
            continue
        elif src.fmt == "parquet":
            raws = _parquet_records(src, cfg, a, b)
        elif src.fmt == "jsonl":
            raws = _jsonl_records(src.path, a, b)
        else:
            raws = _csv_records(src, cfg, a, b, multiline)
        for line, offset, record, error in raws:
            yield _to_row(src.path, line, offset, record, error, cfg)
            count += 1
            if count == cfg.limit:
                return


# --------------------------------------------------------------------------------------------
# Format readers: each yields (line, offset, record, error) for its records in [a, b)


def _open_text(path: str) -> IO[bytes]:
    """A binary handle on a text manifest, decompressing .gz."""
    return gzip.open(path, "rb") if detect_format(path) == "jsonl.gz" else open(path, "rb")


def _sync(fh: IO[bytes], a: int) -> tuple[int, int | None]:
    """Move to the first line start at or after byte `a`; return it and its line number if cheap."""
    if a == 0:
        fh.seek(0)
        return 0, 1
    fh.seek(a - 1)
    fh.readline()  # just the newline when byte a-1 is one, so a line starting at a is kept
    pos = fh.tell()
    if pos > _COUNT_LINES_UP_TO:
        return pos, None
    fh.seek(0)
    newlines, left = 0, pos
    while left:
        chunk = fh.read(min(left, 1 << 20))
        newlines, left = newlines + chunk.count(b"\n"), left - len(chunk)
    return pos, newlines + 1


def _decode_json(raw: bytes) -> tuple[dict[str, Any] | None, MMError | None]:
    """One JSONL line as a JSON object, or the read error."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also UnicodeDecodeError; absurd nesting
        return None, MMError(f"invalid JSON: {exc}", stage="read", reason="manifest.invalid_json",
                             error=type(exc).__name__)
    if not isinstance(value, dict):
        return None, MMError(f"line is {_kind(value)}, not a JSON object", stage="read",
                             reason="manifest.invalid_json")
    return value, None


def _jsonl_records(path: str, a: int, b: int | None,
                   pick: tuple[int, int] | None = None) -> Iterator[_Raw]:
    """JSON lines starting in [a, b) (b None: to the end); `pick` = (i, k) keeps rows n % k == i."""
    with _open_text(path) as fh:
        pos, line = _sync(fh, a)
        n = -1
        while b is None or pos < b:
            try:
                raw = fh.readline()
            except (OSError, EOFError, zlib.error) as exc:  # a truncated or corrupt .gz
                raise ManifestError(f"cannot read manifest {path}: {exc}") from None
            if not raw:
                break
            start, pos = pos, pos + len(raw)
            here, line = line, None if line is None else line + 1
            if start == 0 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if not raw.strip():
                continue
            n += 1
            if pick is not None and n % pick[1] != pick[0]:
                continue
            record, error = _decode_json(raw)
            yield here, start, record, error


class _LineFeed:
    """Decoded lines for csv.reader, remembering where the next line starts and how many lines the
    current record used (the reader pulls exactly the lines a record needs, never more)."""

    def __init__(self, fh: IO[bytes], pos: int, line: int | None) -> None:
        self.fh, self.pos, self.line = fh, pos, line
        self.used, self.bad_utf8 = 0, False

    def __iter__(self) -> "_LineFeed":
        return self

    def __next__(self) -> str:
        raw = self.fh.readline()
        if not raw:
            raise StopIteration
        bom = len(_BOM) if self.pos == 0 and raw.startswith(_BOM) else 0
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


def _csv_header(reader: Any, path: str, cfg: ManifestConfig | None) -> list[str] | None:
    """The header's column names (None for an empty file); checks the id/image/text columns."""
    try:
        header = next((fields for fields in reader if fields), None)
    except csv.Error as exc:
        raise ManifestError(f"cannot read the CSV header of {path}: {exc}") from None
    if header is None:
        return None
    header = [name.strip() for name in header]
    if cfg is not None:
        _check_columns(header, path, cfg)
    return header


def _check_columns(names: Sequence[str], path: str, cfg: ManifestConfig) -> None:
    """A header or schema without the id column, or without both the image and the text column,
    would make every row invalid: a usage error (a wrong --id-key), not millions of error rows."""
    if cfg.id_key not in names:
        raise ManifestError(f'manifest {path} has no "{cfg.id_key}" column '
                            f"(columns: {', '.join(names)})")
    if cfg.image_key not in names and cfg.text_key not in names:
        raise ManifestError(f'manifest {path} has neither an "{cfg.image_key}" nor a '
                            f"\"{cfg.text_key}\" column (columns: {', '.join(names)})")


def _csv_parse(reader: Any, feed: _LineFeed,
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


def _csv_record(header: list[str], fields: list[str] | None, error: MMError | None,
                feed: _LineFeed) -> tuple[dict[str, Any] | None, MMError | None]:
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


def _csv_records(src: _Source, cfg: ManifestConfig, a: int, b: int, multiline: bool) -> Iterator[_Raw]:
    """CSV/TSV records starting in [a, b), by seeking (default) or by parsing from the top."""
    with open(src.path, "rb") as fh:
        feed = _LineFeed(fh, 0, 1)
        reader = csv.reader(feed, delimiter="\t" if src.fmt == "tsv" else ",")
        header = _csv_header(reader, src.path, cfg)
        if header is None:
            return
        body = feed.pos
        shared = a > body or b < src.size
        if a > body and not multiline:
            feed.seek(*_sync(fh, a))
        for start, line, fields, error in _csv_parse(reader, feed, b):
            if start < a:  # csv_multiline: still parsing the prefix to find true record starts
                continue
            if feed.used > 1 and shared and not multiline:
                where = f"line {line}" if line is not None else f"byte {start}"
                raise ManifestError(
                    f"{src.path}: the CSV record at {where} has a quoted field spanning lines, so "
                    "this file cannot be split between tasks by byte ranges: enable csv_multiline "
                    "(--csv-multiline), run one task, or convert the manifest to JSONL/Parquet")
            record, error = _csv_record(header, fields, error, feed)
            yield line, start, record, error


def _parquet_file(path: str) -> Any:
    """Open a Parquet manifest for streaming (buffered column reads, no whole-row-group buffer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"cannot read Parquet manifest {path}: {exc}") from None


def _parquet_records(src: _Source, cfg: ManifestConfig, a: int, b: int) -> Iterator[_Raw]:
    """Parquet rows whose virtual position r*S//N lies in [a, b), reading only their row groups."""
    import pyarrow as pa

    with _parquet_file(src.path) as pf:
        meta, names = pf.metadata, pf.schema_arrow.names
        _check_columns(names, src.path, cfg)
        lo, hi = -(-a * meta.num_rows // src.size), -(-b * meta.num_rows // src.size)
        groups, first, row = [], 0, 0
        for g in range(meta.num_row_groups):
            count = meta.row_group(g).num_rows
            if row < hi and row + count > lo:
                if not groups:
                    first = row
                groups.append(g)
            row += count
        if not groups:
            return
        wanted = (cfg.id_key, cfg.image_key, cfg.text_key, *cfg.keep)
        columns = [c for c in dict.fromkeys(wanted) if c in names]
        row = first
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=groups,
                                         columns=columns):
                i, j = max(lo - row, 0), min(hi - row, batch.num_rows)
                for k, record in enumerate(batch.slice(i, j - i).to_pylist() if j > i else ()):
                    yield None, row + i + k, record, None
                row += batch.num_rows
                if row >= hi:
                    break
        except pa.ArrowException as exc:
            raise ManifestError(f"cannot read Parquet manifest {src.path}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Rereading one record (mmenc errors retry)


def _read_record(path: str, offset: int) -> tuple[dict[str, Any] | None, MMError | None]:
    """The record at `offset` and its read error; ManifestError when there is no record there."""
    fmt = detect_format(path)
    if not os.path.isfile(path):
        raise ManifestError(f"manifest not found: {path}")
    if offset < 0:
        raise ManifestError(f"offset {offset} is negative")
    if fmt == "parquet":
        return _parquet_record(path, offset), None
    with _open_text(path) as fh:
        if fmt == "jsonl.gz" or fmt == "jsonl":
            _check_line_start(fh, path, offset)
            raw = fh.readline()
            if offset == 0 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if not raw.strip():
                raise ManifestError(f"no record at offset {offset} of {path}")
            return _decode_json(raw)
        feed = _LineFeed(fh, 0, 1)
        reader = csv.reader(feed, delimiter="\t" if fmt == "tsv" else ",")
        header = _csv_header(reader, path, None)
        if header is None or offset < feed.pos:
            raise ManifestError(f"offset {offset} of {path} is not a CSV row (header or empty file)")
        _check_line_start(fh, path, offset)
        feed.seek(offset, None)
        for _, _, fields, error in _csv_parse(reader, feed, offset + 1):
            return _csv_record(header, fields, error, feed)
        raise ManifestError(f"no record at offset {offset} of {path}")


def _check_line_start(fh: IO[bytes], path: str, offset: int) -> None:
    """Seek to `offset`, refusing one that is not a line start (the manifest changed since)."""
    if offset > 0:
        fh.seek(offset - 1)
        if fh.read(1) != b"\n":
            raise ManifestError(f"offset {offset} of {path} is not the start of a line: "
                                "has the manifest changed since the run?")
    fh.seek(offset)


def _parquet_record(path: str, offset: int) -> dict[str, Any]:
    """Row `offset` of a Parquet file with all its columns, streaming only its row group."""
    with _parquet_file(path) as pf:
        meta = pf.metadata
        if offset >= meta.num_rows:
            raise ManifestError(f"row {offset} is past the end of {path} ({meta.num_rows} rows)")
        row = 0
        for g in range(meta.num_row_groups):
            if offset < row + meta.row_group(g).num_rows:
                break
            row += meta.row_group(g).num_rows
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=[g]):
            if offset < row + batch.num_rows:
                return batch.slice(offset - row, 1).to_pylist()[0]
            row += batch.num_rows
    raise ManifestError(f"row {offset} not found in {path}")  # metadata and data disagree


# --------------------------------------------------------------------------------------------
# Validation: one record -> ManifestRow or InvalidRow


def _to_row(path: str, line: int | None, offset: int, record: dict[str, Any] | None,
            error: MMError | None, cfg: ManifestConfig) -> ManifestRow | InvalidRow:
    """Validate one record into a ManifestRow, or an InvalidRow saying which key is wrong."""
    row_id = _valid_id(record, cfg.id_key)
    if error is not None:
        return InvalidRow(path, line, offset, error, row_id)
    assert record is not None

    def invalid(message: str, reason: str) -> InvalidRow:
        return InvalidRow(path, line, offset, MMError(message, stage="validate", reason=reason), row_id)

    raw_id = record.get(cfg.id_key)
    if row_id is None and (raw_id is None or isinstance(raw_id, str)):
        what = "no" if raw_id is None else "an empty"
        return invalid(f'row has {what} "{cfg.id_key}" field', "manifest.missing_id")
    if row_id is None:
        return invalid(f'"{cfg.id_key}" must be a string or an integer, not {_kind(raw_id)}',
                       "manifest.invalid_type")
    bad = next((k for k in (cfg.id_key, cfg.text_key, *cfg.keep) if not _utf8(record.get(k))), None)
    if bad is not None:
        return invalid(f'"{bad}" is not valid Unicode (a lone surrogate)', "manifest.invalid_type")
    try:
        image = _image_value(record.get(cfg.image_key))
    except TypeError as exc:
        return invalid(f'"{cfg.image_key}" must be a path, a URL or bytes, not {exc}',
                       "manifest.invalid_type")
    text = record.get(cfg.text_key)
    if text is not None and not isinstance(text, str):
        return invalid(f'"{cfg.text_key}" must be a string, not {_kind(text)}', "manifest.invalid_type")
    if image is None and text is None:
        return invalid(f'row has neither "{cfg.image_key}" nor "{cfg.text_key}"', "manifest.empty_row")
    return ManifestRow(id=row_id, manifest=path, line=line, offset=offset, image=image, text=text,
                       keep={key: record.get(key) for key in cfg.keep},
                       base_dir=os.path.dirname(path))


def _utf8(value: Any) -> bool:
    """False for a str (or a str inside a list/dict) that UTF-8 cannot encode (lone surrogates)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_utf8(k) and _utf8(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_utf8(v) for v in value)
    return True


def _valid_id(record: dict[str, Any] | None, key: str) -> str | None:
    """The row's id as a str when it is a non-blank str or an int (JSON/Parquet ints), else None."""
    value = None if record is None else record.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    value = str(value)
    return value if value.strip() else None


def _image_value(value: Any) -> str | bytes | None:
    """The image as a str or bytes (None when absent or blank); the Hugging Face {bytes, path}
    struct gives its bytes when present, else its path. TypeError names an unusable type."""
    if value is None:
        return None
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value) or None
    if isinstance(value, dict) and value.keys() <= {"bytes", "path"}:
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray)) and data:
            return bytes(data)
        if (data is None or isinstance(data, (bytes, bytearray))) and (path is None or isinstance(path, str)):
            return path if path and path.strip() else None
    raise TypeError(_kind(value))


def _kind(value: Any) -> str:
    """A value's type in words, for messages."""
    return _KINDS.get(type(value), type(value).__name__)
