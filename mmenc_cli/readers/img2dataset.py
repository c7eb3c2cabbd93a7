"""The output folder of img2dataset as a manifest: `mmenc encode laion-shards/`.

img2dataset writes, per shard NNNNN, a metadata Parquet `NNNNN.parquet` (one row per URL it was
given: `key`, `status`, `error_message`, `url`, `caption`, ...), `NNNNN_stats.json`, and the
samples it downloaded in one of three layouts: a WebDataset tar `NNNNN.tar` (`webdataset`), a
folder `NNNNN/` of `KEY.jpg` + `KEY.txt` + `KEY.json` (`files`), or the image bytes in the
metadata Parquet itself (`parquet`, a `jpg`/`png`/`webp` column). Keys are 9 digits.

Every downloaded sample is a row (id: its key); every metadata row whose `status` is not
`success` is "not downloaded", counted apart (not an error, not "skipped"). The metadata's
columns are available to `--keep` (the tar's and folder's `.json` members carry the same).
A shard whose samples are missing is one error row; its rows that were not downloaded still count
(`shards`). Task slices: whole shards, balanced by size (as tar shards are).
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

_STATS = re.compile(r"^\d+_stats\.json$")
_PARTS = re.compile(r"^(\d+)(_stats\.json|\.parquet|\.tar|)$")  # "": the shard's folder
IMAGE_COLUMNS = ("jpg", "png", "webp", "jpeg")


@dataclass(frozen=True, slots=True)
class Shard:
    """One shard of an img2dataset folder: where its samples are, in which layout, and its metadata."""

    data: str  # the tar, the folder, or the Parquet holding the images (where they should be, if missing)
    fmt: str  # "tar", "i2d-files", "i2d-parquet", or "i2d-missing" when its samples are not there
    meta: str  # the metadata Parquet


def shards(folder: str) -> list[Shard] | None:
    """The shards of an img2dataset output folder, in order; None when `folder` is not one.

    A shard is any NNNNN with a stats file, a metadata Parquet, a tar or a folder. It is read from
    its tar or its folder when it has one, else from its metadata Parquet when that holds the
    images; else its samples are missing ("i2d-missing", where the folder's `layout` puts them): a
    shard whose tar was deleted is never taken for a Parquet-layout shard without images.
    """
    entries = dict(files.listdir(folder))
    if not any(_STATS.match(name) for name in entries):
        return None
    parts: dict[str, set[str]] = {}
    for name, is_dir in entries.items():
        m = _PARTS.match(name)
        if m and (m.group(2) == "") == is_dir:
            parts.setdefault(m.group(1), set()).add(m.group(2) or "/")
    kind = layout(folder, parts)
    return [_shard(folder, n, parts[n], kind) for n in sorted(parts)]


def layout(folder: str, parts: dict[str, set[str]]) -> str | None:
    """The folder's layout from what its shards hold: "tar" if any shard has a tar, else "files" if
    any has a folder, else "parquet" if the metadata Parquets have an image column (the first one
    that can be read says), else None (no shard has samples)."""
    if any(".tar" in p for p in parts.values()):
        return "tar"
    if any("/" in p for p in parts.values()):
        return "files"
    for n in sorted(parts):
        if ".parquet" in parts[n]:
            names = _columns(files.join(folder, f"{n}.parquet"))
            if names is not None:
                return "parquet" if set(names) & set(IMAGE_COLUMNS) else None
    return None


def _shard(folder: str, n: str, parts: set[str], kind: str | None) -> Shard:
    meta = files.join(folder, f"{n}.parquet")
    if ".tar" in parts:
        return Shard(files.join(folder, f"{n}.tar"), "tar", meta)
    if "/" in parts:
        return Shard(files.join(folder, n), "i2d-files", meta)
    if ".parquet" in parts and (kind == "parquet" or kind is not None and _has_images(meta)):
        return Shard(meta, "i2d-parquet", meta)  # its own footer read only where the layout is another
    expected = {"tar": f"{n}.tar", "parquet": f"{n}.parquet"}.get(kind or "", n)
    return Shard(files.join(folder, expected), "i2d-missing", meta)


def _has_images(path: str) -> bool:
    """Whether a metadata Parquet holds the images (has an image column)."""
    return bool(set(_columns(path) or ()) & set(IMAGE_COLUMNS))


def _columns(path: str) -> list[str] | None:
    """The column names of a Parquet file; None when it cannot be read."""
    try:
        pf, names = open_parquet(path)
    except read_errors():
        return None
    pf.close()
    return names


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
            elif record is not None and record.get("status") != "success":
                yield _failed(meta, row, record)


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
