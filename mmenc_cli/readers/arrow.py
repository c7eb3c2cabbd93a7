"""Arrow IPC files and Hugging Face datasets saved with `save_to_disk`, as manifests.

An `.arrow` file may be in the Arrow IPC file format or the stream format (`datasets` writes
the stream format); it is read record batch by record batch, only the columns a row needs. A
`save_to_disk` folder is its `state.json`'s data files in order (a `DatasetDict` folder: each
split's, in `dataset_dict.json`'s order). The `Image` feature's `{bytes, path}` struct gives the
image's bytes (or its path). Task slices: record batch b of a file belongs to task b % k;
`offset` is the row's index in the file. Each batch is validated before its rows are made
(`batches.py`); a data file the listing names that is gone is one error row (`missing.py`).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from . import files
from .batches import checked_records, find_row, lost_rows, read_errors
from .lines import Raw
from .missing import MISSING
from .registry import SPREAD, Format, Part, Planned, Source, register
from .validate import Keys, check_columns

#: path -> the byte its reader has reached, while it is read: where a task is in the file (progress)
_AT: dict[str, int] = {}


def data_files(folder: str) -> list[tuple[str, str]] | None:
    """The Arrow files of a `save_to_disk` folder, in order, each with the JSON file that lists it
    (a listed file may be missing); None when `folder` is not one. ManifestError names a
    `state.json` or `dataset_dict.json` that is not what `datasets` writes."""
    state = files.join(folder, "state.json")
    if files.info(state).exists:
        listed = _listing(state, "_data_files")
        if not all(isinstance(e, dict) and isinstance(e.get("filename"), str) for e in listed):
            raise ManifestError(f"{state} is damaged: its _data_files are not objects with a filename")
        return [(files.join(folder, entry["filename"]), state) for entry in listed]
    splits = files.join(folder, "dataset_dict.json")
    if not files.info(splits).exists:
        return None
    names = _listing(splits, "splits")
    if not all(isinstance(name, str) for name in names):
        raise ManifestError(f"{splits} is damaged: its splits are not names")
    out: list[tuple[str, str]] = []
    for name in names:
        listed = data_files(files.join(folder, name))
        out += listed if listed is not None else [(files.join(folder, name, "state.json"), splits)]
    return out


def _listing(path: str, key: str) -> list[Any]:
    """The list under `key` in a saved dataset's JSON file (absent: empty); ManifestError when
    the file cannot be read or is not such JSON."""
    try:
        with files.open_binary(path) as fh:
            doc = json.loads(fh.read())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read saved dataset file {path}: {exc}") from None
    listed = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or not isinstance(listed, (list, type(None))):
        raise ManifestError(f"{path} is damaged: not the JSON object `datasets` writes (no {key} list)")
    return listed or []


def _batches(fh: Any) -> Iterator[Any]:
    """The record batches of an IPC file or stream."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_file(fh)
    except pa.ArrowInvalid:
        fh.seek(0)
        try:
            stream = pa.ipc.open_stream(fh)
        except pa.ArrowInvalid as exc:
            raise pa.ArrowInvalid(f"not an Arrow IPC file or stream: {exc}") from None
        yield from map(_counted, stream)
        at, size = fh.tell(), fh.seek(0, 2)
        if at < size:  # a damaged message header reads as the end of the stream: rows would vanish
            raise pa.ArrowInvalid(f"the stream ends at byte {at} of {size}")
        return
    for i in range(reader.num_record_batches):
        yield _counted(reader.get_batch(i))


def _counted(batch: Any) -> Any:
    """A batch whose row count can place the rows after it (a damaged header can say -5)."""
    if batch.num_rows < 0:
        raise ValueError(f"a record batch of {batch.num_rows} rows")
    return batch


def arrow_records(path: str, keys: Keys, pick: tuple[int, int] | None) -> Iterator[Raw]:
    """The rows of this task's record batches (`pick` = (i, k): batches b % k == i). A batch that
    cannot be read ends the file (the rest is one error row: a stream cannot be resynchronized);
    a batch that is read but damaged is its own error row, or one per bad row (`batches.py`)."""
    row = b = 0
    try:
        with files.open_binary(path) as fh:
            for batch in _batches(fh):
                _AT[path] = fh.tell()
                if b == 0:
                    check_columns(batch.schema.names, path, keys)
                if pick is None or b % pick[1] == pick[0]:
                    wanted = [c for c in keys.columns if c in batch.schema.names]
                    yield from checked_records(batch.select(wanted), path, row)
                row += batch.num_rows
                b += 1
    except ManifestError:
        raise
    except read_errors() as exc:  # reported by the task the unreadable batch belongs to
        if pick is None or b % pick[1] == pick[0]:
            yield None, row, None, lost_rows(path, row, None, exc)
    finally:
        _AT.pop(path, None)


def arrow_record(path: str, offset: int) -> dict[str, Any]:
    """Row `offset` of an Arrow file with all its columns (for `mmenc errors retry`)."""
    try:
        with files.open_binary(path) as fh:
            found = find_row(_batches(fh), offset, path)
    except read_errors() as exc:  # the file cannot be opened as Arrow at all
        raise ManifestError(f"{path} cannot be read: {exc}") from None
    if found is None:
        raise ManifestError(f"row {offset} is past the end of {path}")
    return found


class Arrow(Format):
    """`.arrow` (IPC file or stream): every k-th record batch to task i of k."""

    name, extensions, slicing = "arrow", (".arrow",), SPREAD

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Raw]:
        """The rows of the task's record batches."""
        return arrow_records(src.path, self.keys(cfg), part.pick)

    def spread_room(self, src: Source) -> int | None:
        """The file's size: every task reads past every batch, converting only its own."""
        return src.length or None

    def position(self, src: Source, offset: int) -> int | None:
        """The byte the file's reader has reached (the end of the row's batch)."""
        return _AT.get(src.path)

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """Row `offset`, all its columns."""
        return arrow_record(path, offset), None


class SavedDataset(Arrow):
    """A `save_to_disk` folder (a `state.json`, or a `dataset_dict.json` of splits): its data
    files are Arrow files, read as such; a listed one that is gone is a missing source."""

    name, extensions, rank = "saved-dataset", (), -2

    def expand(self, folder: str) -> list[Planned] | None:
        """Its data files in order, or None when `folder` is not a saved dataset."""
        listed = data_files(folder)
        if listed is None:
            return None
        found = [(p, by, files.info(p)) for p, by in listed]  # the size, for progress: a spread source takes no room
        return [(self, p, got.size, None) if got.exists else (MISSING, p, 0, by) for p, by, got in found]


ARROW = register(Arrow())
SAVED_DATASET = register(SavedDataset())
