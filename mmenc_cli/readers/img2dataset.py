"""The output folder of img2dataset as a manifest: `mmenc encode laion-shards/`.

img2dataset writes, per shard NNNNN, a metadata Parquet `NNNNN.parquet` (one row per URL it was
given: `key`, `status`, `error_message`, `url`, `caption`, ...), `NNNNN_stats.json`, and the
samples it downloaded in one of three layouts: a WebDataset tar `NNNNN.tar` (`webdataset`), a
folder `NNNNN/` of `KEY.jpg` + `KEY.txt` + `KEY.json` (`files`), or the image bytes in the
metadata Parquet itself (`parquet`, a `jpg`/`png`/`webp` column). Keys are 9 digits.

Every downloaded sample is a row (id: its key); every metadata row whose `status` is not
`success` is "not downloaded", counted apart (not an error, not "skipped"). The metadata's
columns are available to `--keep` (the tar's and folder's `.json` members carry the same).
Task slices: whole shards, balanced by size (as tar shards are).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

from ..records import NotDownloaded
from . import files
from .lines import Raw

_STATS = re.compile(r"^(\d+)_stats\.json$")
IMAGE_COLUMNS = ("jpg", "png", "webp", "jpeg")


@dataclass(frozen=True, slots=True)
class Shard:
    """One shard of an img2dataset folder: where its samples are, in which layout, and its metadata."""

    data: str  # the tar, the folder, or the Parquet holding the images
    fmt: str  # "tar", "i2d-files" or "i2d-parquet"
    meta: str  # the metadata Parquet


def shards(folder: str) -> list[Shard] | None:
    """The shards of an img2dataset output folder, in order; None when `folder` is not one."""
    entries = dict(files.listdir(folder))
    numbers = sorted(m.group(1) for name in entries if (m := _STATS.match(name)))
    if not numbers:
        return None
    out = []
    for n in numbers:
        meta = files.join(folder, f"{n}.parquet")
        if f"{n}.tar" in entries:
            out.append(Shard(files.join(folder, f"{n}.tar"), "tar", meta))
        elif entries.get(n):  # a folder
            out.append(Shard(files.join(folder, n), "i2d-files", meta))
        elif f"{n}.parquet" in entries:
            out.append(Shard(meta, "i2d-parquet", meta))
    return out


def not_downloaded(meta: str) -> Iterator[NotDownloaded]:
    """The metadata rows whose download failed (`status` other than `success`)."""
    import pyarrow.parquet as pq

    if not files.info(meta).exists:
        return
    with files.open_binary(meta) as fh:
        pf = pq.ParquetFile(fh)
        columns = [c for c in ("key", "status", "error_message") if c in pf.schema_arrow.names]
        if "status" not in columns:
            return
        row = 0
        for batch in pf.iter_batches(batch_size=4096, columns=columns):
            for k, record in enumerate(batch.to_pylist()):
                if record.get("status") != "success":
                    yield NotDownloaded(meta, row + k, record.get("key"), record.get("status"),
                                        record.get("error_message"))
            row += batch.num_rows


def parquet_samples(path: str) -> Iterator[Raw | NotDownloaded]:
    """The `parquet` layout: downloaded rows (with their image bytes) and the others, counted apart."""
    import pyarrow.parquet as pq

    with files.open_binary(path) as fh:
        pf = pq.ParquetFile(fh)
        row = 0
        for batch in pf.iter_batches(batch_size=256):
            for k, record in enumerate(batch.to_pylist()):
                if record.get("status", "success") == "success":
                    yield None, row + k, record, None
                else:
                    yield NotDownloaded(path, row + k, record.get("key"), record.get("status"),
                                        record.get("error_message"))
            row += batch.num_rows
