"""Record batches of Arrow and Parquet inputs turned into records without trusting them.

A damaged file can hold a batch whose buffers, offsets or strings are wrong; converted as it is,
pyarrow raises UnicodeDecodeError or SystemError, or reads out of bounds and kills the process.
So every batch is validated in full first. A batch that is sound but for some string cells that
are not UTF-8 gives one invalid row per such row (its other rows are kept); a batch damaged
otherwise is one `manifest.bad_shard` error for the rows it covers.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import ManifestError, MMError
from .lines import Raw


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged Arrow or Parquet file raises (pyarrow's errors, OSError, a
    UnicodeDecodeError from a schema's names, a SystemError from a conversion gone wrong, a
    MemoryError from a length that asks for terabytes)."""
    import pyarrow as pa

    return pa.ArrowException, OSError, ValueError, SystemError, MemoryError


def lost_rows(path: str, first: int, count: int | None, cause: BaseException | str) -> MMError:
    """The error of rows that cannot be read: `count` rows from `first` on (None: to the end)."""
    what = (f"from row {first} on" if count is None else
            f"row {first}" if count == 1 else f"rows {first} to {first + count - 1}")
    rest = "the rest of the file is lost" if count is None else "they are lost, the rest of the file is read"
    return MMError(f"{path} cannot be read {what} ({_cause(cause)}): {rest}", stage="read",
                   reason="manifest.bad_shard")


def checked_records(batch: Any, path: str, first: int) -> Iterator[Raw]:
    """The rows of `batch` (row `first` of the file first) as records, after validating it in full."""
    import pyarrow as pa

    try:
        batch.validate(full=True)
    except pa.ArrowException as exc:
        if _sound_as_bytes(batch):  # only strings that are not UTF-8: keep the rows around them
            yield from _row_by_row(batch, path, first)
        else:
            yield None, first, None, lost_rows(path, first, batch.num_rows, exc)
        return
    try:
        records = batch.to_pylist()
    except read_errors():  # a value Python cannot hold (a date past year 9999): find its row
        yield from _row_by_row(batch, path, first)
        return
    for k, record in enumerate(records):
        yield None, first + k, record, None


def checked_row(batch: Any, k: int, path: str, offset: int) -> dict[str, Any]:
    """Row `k` of `batch` (row `offset` of the file) with all its columns, validated first: what
    `mmenc errors retry` rereads. ManifestError says which cell is unreadable."""
    record, bad = _cells(batch.slice(k, 1))
    if bad:
        raise ManifestError(f"row {offset} of {path} cannot be read: {bad[0][1]}")
    return record


def find_row(batches: Iterator[Any], offset: int, path: str, first: int = 0) -> dict[str, Any] | None:
    """Row `offset` of a file whose record batches, from row `first` on, are `batches`, checked
    (`checked_row`); None when they end before it. ManifestError when a batch cannot be read."""
    row = first
    try:
        for batch in batches:
            if offset < row + batch.num_rows:
                return checked_row(batch, offset - row, path, offset)
            row += batch.num_rows
    except ManifestError:
        raise
    except read_errors() as exc:
        raise ManifestError(f"{path} cannot be read from row {row} on: {exc}") from None
    return None


def _row_by_row(batch: Any, path: str, first: int) -> Iterator[Raw]:
    """Each row of a batch whose structure is sound, a row with an unreadable cell as that row's error."""
    for k in range(batch.num_rows):
        record, bad = _cells(batch.slice(k, 1))
        if not bad:
            yield None, first + k, record, None
            continue
        reason = "manifest.invalid_type" if bad[0][0] else "manifest.invalid_row"
        yield None, first + k, record, MMError(bad[0][1], stage="validate", reason=reason)


def _cells(row: Any) -> tuple[dict[str, Any], list[tuple[bool, str]]]:
    """A one-row batch's readable cells, and (is it bad UTF-8, message) for each unreadable one."""
    import pyarrow as pa

    record: dict[str, Any] = {}
    bad: list[tuple[bool, str]] = []
    for name, column in zip(row.schema.names, row.columns):
        try:
            column.validate(full=True)
        except pa.ArrowException as exc:
            utf8 = _valid(lambda: column.view(_as_bytes(column.type)))
            bad.append((utf8, f'"{name}" is {"not valid UTF-8" if utf8 else "damaged"} ({_cause(exc)})'))
            continue
        try:
            record[name] = column.to_pylist()[0]
        except read_errors() as exc:
            bad.append((False, f'"{name}" cannot be read ({_cause(exc)})'))
    return record, bad


def _sound_as_bytes(batch: Any) -> bool:
    """Whether the batch validates with its string columns taken as binary: its only faults are
    strings that are not UTF-8."""
    import pyarrow as pa

    return _valid(lambda: pa.RecordBatch.from_arrays([c.view(_as_bytes(c.type)) for c in batch.columns],
                                                     names=batch.schema.names))


def _valid(make: Any) -> bool:
    """Whether the array or batch `make()` returns can be made and validates in full."""
    try:
        make().validate(full=True)
    except read_errors():
        return False
    return True


def _as_bytes(t: Any) -> Any:
    """Type `t` with every string type inside it replaced by the binary type of the same layout."""
    import pyarrow as pa

    types = pa.types
    if types.is_string(t):
        return pa.binary()
    if types.is_large_string(t):
        return pa.large_binary()
    if types.is_string_view(t):
        return pa.binary_view()
    if types.is_struct(t):
        return pa.struct([t.field(i).with_type(_as_bytes(t.field(i).type)) for i in range(t.num_fields)])
    if types.is_map(t):
        return pa.map_(_as_bytes(t.key_type), _as_bytes(t.item_type))
    if types.is_list(t) or types.is_large_list(t) or types.is_fixed_size_list(t):
        field = t.value_field.with_type(_as_bytes(t.value_type))
        if types.is_fixed_size_list(t):
            return pa.list_(field, t.list_size)
        return pa.large_list(field) if types.is_large_list(t) else pa.list_(field)
    return t


def _cause(exc: BaseException | str) -> str:
    """An exception as a short cause: its type and first line."""
    if isinstance(exc, str):
        return exc
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
