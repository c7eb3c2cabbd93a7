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
(`shards`). Task slices: whole shards, balanced by size (as tar shards are); a `files` shard is
placed by its metadata's size.

Each layout is a format of its own (`I2D_TAR`, `I2D_FILES`, `I2D_PARQUET`, `I2D_MISSING`); the
output folder as a whole is told apart by `IMG2DATASET`, since the layout is decided for the folder.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Iterator

from ..config import ManifestConfig
from ..errors import MMError
from ..records import InvalidRow, NotDownloaded
from . import files
from .batches import read_errors
from .folder import Folder
from .lines import Raw
from .missing import Missing
from .parquet import open_parquet, parquet_record, parquet_rows, unopenable
from .registry import WHOLE, Format, Part, Planned, Record, Source, register
from .tar import Tar
from .validate import TAR_IMAGES, Keys, option_keys

_STATS = re.compile(r"^\d+_stats\.json$")
_STATS_SUFFIX = "_stats.json"
_PARTS = re.compile(r"^(\d+)(_stats\.json|\.parquet|\.tar|)$")  # "": the shard's folder
IMAGE_COLUMNS = ("jpg", "png", "webp", "jpeg")


@dataclass(frozen=True, slots=True)
class Shard:
    """One shard of an img2dataset folder: where its samples are, in which layout, and its metadata."""

    data: str  # the tar, the folder, or the Parquet holding the images (where they should be, if missing)
    fmt: Format  # its layout's format, or I2D_MISSING when its samples are not there
    meta: str  # the metadata Parquet
    sized: str  # the file whose size places the shard in the byte space (a folder's: its metadata)


def shards(folder: str) -> list[Shard] | None:
    """The shards of an img2dataset output folder, in order; None when `folder` is not one.

    A shard is any NNNNN with a stats file, a metadata Parquet, a tar or a folder. It is read from
    its tar or its folder when it has one, else from its metadata Parquet when that holds the
    images; else its samples are missing (`I2D_MISSING`, where the folder's `layout` puts them): a
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
        tar = files.join(folder, f"{n}.tar")
        return Shard(tar, I2D_TAR, meta, tar)
    if "/" in parts:
        return Shard(files.join(folder, n), I2D_FILES, meta, meta)
    if ".parquet" in parts and (kind == "parquet" or kind is not None and _has_images(meta)):
        return Shard(meta, I2D_PARQUET, meta, meta)  # its own footer read only where the layout is another
    expected = files.join(folder, {"tar": f"{n}.tar", "parquet": f"{n}.parquet"}.get(kind or "", n))
    return Shard(expected, I2D_MISSING, meta, expected)


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


def _size(path: str) -> int:
    found = files.info(path)
    return found.size if found.exists else 0


def stats_beside(path: str) -> bool:
    """Whether a shard's `NNNNN_stats.json` is beside `path` (a shard's tar, folder or Parquet)."""
    parent, name = posixpath.split(path.rstrip("/")) if files.is_url(path) else os.path.split(os.path.normpath(path))
    return files.info(files.join(parent, name.split(".", 1)[0] + _STATS_SUFFIX)).exists


def _not_downloaded(src: Source) -> Iterator[NotDownloaded | InvalidRow]:
    """A shard's metadata rows that were not downloaded (none without metadata)."""
    return not_downloaded(src.meta) if src.meta is not None else iter(())


class Img2datasetOutput(Format):
    """An img2dataset output folder (it has `NNNNN_stats.json` files): never a source itself, its
    shards are sources of the layouts' formats."""

    name, rank = "img2dataset", -1

    def expand(self, folder: str) -> list[Planned] | None:
        """Its shards in order, each placed by its size; None when `folder` is not one."""
        found = shards(folder)
        return None if found is None else [(s.fmt, s.data, _size(s.sized), s.meta) for s in found]


class I2DTar(Tar):
    """A shard of the `webdataset` layout: its tar's samples, then its rows not downloaded."""

    name, extensions = "i2d-tar", ()

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        """The samples, then the metadata rows that were not downloaded."""
        yield from super().records(src, cfg, part)
        yield from _not_downloaded(src)


class I2DFiles(Folder):
    """A shard folder of the `files` layout: whole, its samples keyed by path, ids their file stems."""

    name, slicing, rank = "i2d-files", WHOLE, -1
    id_key = "__stem__"  # img2dataset's key, the stem of the sample's files

    def expand(self, folder: str) -> list[Planned] | None:
        """Told apart as a shard of its output (`IMG2DATASET`), never on its own."""
        return None

    def recognizes(self, path: str, is_dir: bool) -> bool:
        """A folder with its shard's stats file beside it."""
        return is_dir and stats_beside(path)

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        """The samples, then the metadata rows that were not downloaded."""
        yield from super().records(src, cfg, part)
        yield from _not_downloaded(src)


class I2DParquet(Format):
    """A metadata Parquet of the `parquet` layout, which holds the images: whole; id `key`,
    image the first of its image columns, text `caption`."""

    name, slicing, rank, rewritten = "i2d-parquet", WHOLE, -1, True

    def recognizes(self, path: str, is_dir: bool) -> bool:
        """A Parquet file with its shard's stats file beside it."""
        return not is_dir and path.lower().endswith(".parquet") and stats_beside(path)

    def keys(self, cfg: ManifestConfig) -> Keys:
        """`key`, the image columns in order, `caption` (or the options)."""
        return option_keys(cfg, "key", TAR_IMAGES, "caption")

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        """Its downloaded rows and, counted apart, the others."""
        return parquet_samples(src.path)

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """Row `offset`, all its columns."""
        return parquet_record(path, offset), None


class I2DMissing(Missing):
    """A shard whose samples are missing: one error row, then its rows not downloaded (the
    metadata still says so)."""

    name = "i2d-missing"

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        """The error row, then the metadata rows that were not downloaded."""
        yield self.missing(src)
        yield from _not_downloaded(src)

    def message(self, src: Source) -> str:
        """Where the samples should be, and that the shard's stats or metadata are there."""
        return (f"{src.path} does not exist: the samples of this img2dataset shard are missing "
                "(its stats or metadata are there)")


IMG2DATASET = register(Img2datasetOutput())
I2D_TAR = register(I2DTar())
I2D_FILES = register(I2DFiles())
I2D_PARQUET = register(I2DParquet())
I2D_MISSING = register(I2DMissing())
