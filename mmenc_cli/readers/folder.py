"""A folder of files as a manifest: `mmenc encode photos/`.

Image, audio and video files are found recursively, in sorted order (by name, folder by folder),
by extension (`SUFFIXES`); the media files of one stem in a folder (`walk.jpg`, `walk.mp4`) are
one sample, named by the first of them (two of one medium, `walk.jpg` and `walk.png`, are two); symlinks are followed once (a link back to a folder already walked is
skipped); hidden files and folders (a name starting with `.`) are skipped. A sample's id is its
path relative to the folder; a `.txt` file beside a media file with the same stem is its text (the
layout clip-retrieval's `files` input and img2dataset's `files` output use), and a `.json` beside
it supplies fields for `--keep`. The walk is a stream: nothing but the current folder's listing
is held.

Task slices: sample n (in walk order) belongs to task n % k; `offset` is n, and `line` is None.
A sample is found again by its relative path (its `key`), since its place in the walk moves.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any, Iterator

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from . import files
from .lines import Raw, row_too_large
from .registry import SPREAD, Format, Part, Planned, Record, Source, register
from .validate import Keys

#: image files a folder manifest picks up (lower-cased suffixes)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
#: the media files a folder manifest picks up, by medium
SUFFIXES = {"image": IMAGE_SUFFIXES, "audio": (".wav", ".flac", ".mp3", ".opus", ".ogg", ".m4a"),
            "video": (".mp4", ".webm", ".mkv", ".mov")}
_ALL_SUFFIXES = tuple(suffix for group in SUFFIXES.values() for suffix in group)


def medium_of(name: str) -> str:
    """The medium a media file's name says ("image" for anything else)."""
    lower = name.lower()
    return next((m for m, group in SUFFIXES.items() if lower.endswith(group)), "image")


#: one sample of a folder: {medium: file name}, and the folder's {name: is_dir}
Sample = tuple[dict[str, str], dict[str, bool]]


def walk(root: str) -> Iterator[tuple[str, Sample]]:
    """(relative path of its first file, its sample) of every sample under `root`, in sorted
    order, hidden entries skipped, each real folder walked once."""
    seen: set[str] = set()

    def visit(folder: str, rel: str) -> Iterator[tuple[str, Sample]]:
        key = files.real(folder)
        if key in seen:
            return
        seen.add(key)
        entries = [(n, d) for n, d in files.listdir(folder) if not n.startswith(".")]
        names = dict(entries)
        firsts = group_media(entries)
        for name, is_dir in entries:
            path = posixpath.join(rel, name) if rel else name
            if is_dir:
                yield from visit(files.join(folder, name), path)
            elif name in firsts:
                yield path, (firsts[name], names)

    yield from visit(root, "")


def group_media(entries: list[tuple[str, bool]]) -> dict[str, dict[str, str]]:
    """The samples of one folder's sorted listing, by the name of their first file: the media files
    of one stem, at most one of each medium (`walk.jpg` + `walk.mp4` is one sample; `walk.jpg` and
    `walk.png` are two)."""
    by_stem: dict[str, list[dict[str, str]]] = {}
    firsts: dict[str, dict[str, str]] = {}
    for name, is_dir in entries:
        if is_dir or not name.lower().endswith(_ALL_SUFFIXES):
            continue
        medium, groups = medium_of(name), by_stem.setdefault(name.rsplit(".", 1)[0], [])
        group = next((g for g in groups if medium not in g), None)
        if group is None:
            group = firsts[name] = {}
            groups.append(group)
        group[medium] = name
    return firsts


def folder_records(root: str, pick: tuple[int, int] | None, limit: int) -> Iterator[Raw]:
    """One record per sample of this task's share (`pick` = (i, k): samples n % k == i)."""
    for n, (rel, found) in enumerate(walk(root)):
        if pick is not None and n % pick[1] != pick[0]:
            continue
        yield None, n, *sample(root, rel, limit, found)


def sample(root: str, rel: str, limit: int, found: Sample | None = None) -> tuple[dict[str, Any] | None, MMError | None]:
    """The record of the sample whose first media file is `rel` under `root` (`found`: its files and
    its folder's listing, else listed here): its media files (`walk.jpg` + `walk.mp4` +
    `walk.flac`), and the text and fields of the `.txt` and `.json` files beside it (each at most
    `limit` bytes, else the sample is a 413 row)."""
    stem = rel.rsplit(".", 1)[0]
    base, parent = posixpath.basename(stem), posixpath.dirname(rel)
    if found is None:
        names = dict(files.listdir(files.join(root, *parent.split("/")) if parent else root))
        name = posixpath.basename(rel)
        found = group_media(sorted(names.items())).get(name, {medium_of(name): name}), names
    media, names = found
    record: dict[str, Any] = {"__key__": rel, "__stem__": base}
    record.update((f"__{medium}__", posixpath.join(parent, name)) for medium, name in media.items())
    try:
        if f"{base}.json" in names:
            fields = _read_sibling(root, stem + ".json", limit)
            if fields is not None:
                value = json.loads(fields)
                if isinstance(value, dict):
                    record = {**value, **record}
        if f"{base}.txt" in names:
            text = _read_sibling(root, stem + ".txt", limit)
            if text is not None:
                record["__text__"] = text.decode("utf-8").strip()
    except _TooLarge as exc:
        return record, row_too_large(exc.size, limit)
    except (ValueError, OSError) as exc:  # a .txt that is not UTF-8, a .json that is not JSON
        return record, MMError(f"the files beside {rel} cannot be read: {type(exc).__name__}: {exc}",
                               stage="read", reason="manifest.invalid_row", error=type(exc).__name__)
    return record, None


class _TooLarge(Exception):
    def __init__(self, size: int) -> None:
        self.size = size


def _read_sibling(root: str, rel: str, limit: int) -> bytes | None:
    path = files.join(root, *rel.split("/"))
    found = files.info(path)
    if not found.exists:
        return None
    if found.size > limit:
        raise _TooLarge(found.size)
    with files.open_binary(path) as fh:
        return fh.read(limit + 1)


def folder_record(root: str, offset: int, rel: str | None, limit: int) -> tuple[dict[str, Any] | None, MMError | None]:
    """A folder's sample by its relative path (its place in the walk moves as files come and go;
    only a row written before samples had keys is found by it)."""
    if rel is not None:
        if not files.info(files.join(root, *rel.split("/"))).exists:
            raise ManifestError(f"{root} has no file {rel} any more: has the folder changed since the run?")
        return sample(root, rel, limit)
    for n, (first, found) in enumerate(walk(root)):
        if n == offset:
            return sample(root, first, limit, found)
    raise ManifestError(f"{root} has no sample number {offset}: has the folder changed since the run?")


class Folder(Format):
    """A folder of media files (any folder no other format claims): every k-th sample, found
    again by its relative path; media paths relative to the folder; fixed keys."""

    name, slicing, rank, keyed, rewritten = "folder", SPREAD, 1, True, True
    id_key = "__key__"  # the relative path of the sample's first file

    def expand(self, folder: str) -> list[Planned] | None:
        """The folder itself is the source."""
        return [(self, folder, 0, None)]

    def recognizes(self, path: str, is_dir: bool) -> bool:
        """Any folder."""
        return is_dir

    def keys(self, cfg: ManifestConfig) -> Keys:
        """The sample's own media and `.txt` (only the id may be another `.json` field)."""
        return Keys(cfg.id_key or self.id_key, ("__image__",), "__text__", tuple(cfg.keep), ("__audio__",),
                    ("__video__",))

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        """The task's every k-th sample (all of them for a whole `part`)."""
        return folder_records(src.path, part.pick, cfg.max_row_bytes)

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """The sample at `key` (else the `offset`-th of the walk)."""
        return folder_record(path, offset, key, limit)

    def base_dir(self, path: str) -> str:
        """The folder."""
        return path

    def key_of(self, record: dict[str, Any] | None) -> str | None:
        """The relative path of the sample's first file."""
        return None if record is None else record.get("__key__")


FOLDER = register(Folder())
