"""Arrow IPC files and Hugging Face datasets saved with `save_to_disk`, as manifests.

An `.arrow` file may be in the Arrow IPC file format or the stream format (`datasets` writes
the stream format); it is read record batch by record batch, only the columns a row needs. A
`save_to_disk` folder is its `state.json`'s data files in order (a `DatasetDict` folder: each
split's, in `dataset_dict.json`'s order). The `Image` feature's `{bytes, path}` struct gives the
image's bytes (or its path). Task slices: record batch b of a file belongs to task b % k;
`offset` is the row's index in the file.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from ..errors import ManifestError, MMError
from . import files
from .lines import Raw
from .validate import Keys, check_columns


def data_files(folder: str) -> list[str] | None:
    """The Arrow files of a `save_to_disk` folder, in order; None when it is not one."""
    state = files.join(folder, "state.json")
    if files.info(state).exists:
        with files.open_binary(state) as fh:
            listed = json.loads(fh.read()).get("_data_files") or []
        return [files.join(folder, entry["filename"]) for entry in listed]
    splits = files.join(folder, "dataset_dict.json")
    if files.info(splits).exists:
        with files.open_binary(splits) as fh:
            names = json.loads(fh.read()).get("splits") or []
        return [path for name in names for path in (data_files(files.join(folder, name)) or [])]
    return None


def _batches(fh: Any, path: str) -> Iterator[Any]:
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
        yield from stream
        return
    for i in range(reader.num_record_batches):
        yield reader.get_batch(i)


def arrow_records(path: str, keys: Keys, pick: tuple[int, int] | None) -> Iterator[Raw]:
    """The rows of this task's record batches (`pick` = (i, k): batches b % k == i)."""
    import pyarrow as pa

    row = b = 0
    with files.open_binary(path) as fh:
        try:
            for b, batch in enumerate(_batches(fh, path)):
                if b == 0:
                    check_columns(batch.schema.names, path, keys)
                if pick is None or b % pick[1] == pick[0]:
                    wanted = [c for c in keys.columns if c in batch.schema.names]
                    for k, record in enumerate(batch.select(wanted).to_pylist()):
                        yield None, row + k, record, None
                row += batch.num_rows
                b += 1
        except (pa.ArrowException, OSError) as exc:  # reported by the task the unreadable batch belongs to
            if pick is None or b % pick[1] == pick[0]:
                yield None, row, None, MMError(f"{path} cannot be read from row {row} on ({exc}): the rest of the "
                                               "file is lost", stage="read", reason="manifest.bad_shard")


def arrow_record(path: str, offset: int) -> dict[str, Any]:
    """Row `offset` of an Arrow file with all its columns (for `mmenc errors retry`)."""
    import pyarrow as pa

    row = 0
    with files.open_binary(path) as fh:
        try:
            for batch in _batches(fh, path):
                if offset < row + batch.num_rows:
                    return batch.slice(offset - row, 1).to_pylist()[0]
                row += batch.num_rows
        except (pa.ArrowException, OSError) as exc:
            raise ManifestError(f"{path} cannot be read from row {row} on: {exc}") from None
    raise ManifestError(f"row {offset} is past the end of {path} ({row} rows)")
