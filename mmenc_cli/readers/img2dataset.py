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
from typing import Any, Iterator

from ..records import InvalidRow, NotDownloaded
from . import files
from .batches import read_errors
from .lines import Raw
from .parquet import open_parquet, parquet_rows, unopenable

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


def not_downloaded(meta: str) -> Iterator[NotDownloaded | InvalidRow]:
    """The metadata rows whose download failed (`status` other than `success`); a part of the
    metadata that cannot be read is an error row of its own (the samples are not in it)."""
    if not files.info(meta).exists:
        return
    try:
        pf, names = open_parquet(meta)
    except read_errors() as exc:
        yield InvalidRow(meta, None, 0, unopenable(meta, exc))
        return
    with pf:
        if "status" not in names:
            return
        columns = [c for c in ("key", "status", "error_message") if c in names]
        for _, row, record, error in parquet_rows(pf, meta, columns):
            if error is not None:
                yield InvalidRow(meta, None, row, error, _key(record))
            elif record.get("status") != "success":  # type: ignore[union-attr]
                yield _failed(meta, row, record)  # type: ignore[arg-type]


def parquet_samples(path: str) -> Iterator[Raw | NotDownloaded]:
    """The `parquet` layout: downloaded rows (with their image bytes) and the others, counted apart."""
    try:
        pf, _ = open_parquet(path)
    except read_errors() as exc:
        yield None, 0, None, unopenable(path, exc)
        return
    with pf:
        for raw in parquet_rows(pf, path, None):
            record = raw[2]
            if raw[3] is None and record is not None and record.get("status", "success") != "success":
                yield _failed(path, raw[1], record)
            else:
                yield raw


def _failed(path: str, row: int, record: dict[str, Any]) -> NotDownloaded:
    return NotDownloaded(path, row, record.get("key"), record.get("status"), record.get("error_message"))


def _key(record: dict[str, Any] | None) -> str | None:
    key = None if record is None else record.get("key")
    return key if isinstance(key, str) else None
