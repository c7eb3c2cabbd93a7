"""The input formats: one `Format` object per format, registered once, that planning, task
slices, rereading and the error report's retry ask instead of comparing format names.

A format says how it is detected (a file's extension, or what a folder holds), how a task reads
its records (byte ranges of the tasks' byte space, every k-th part, or whole), how one record is
read again for `mmenc errors retry` (by offset, or by key), its default keys, the folder its
relative media paths start from, and whether a retried record keeps its own fields. Each format
module registers its objects (`register`) when it is imported; `mmenc_cli.readers` imports the
built-in ones, so a lookup always sees them. A new format is a `Format` subclass, registered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, TypeVar

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from ..records import InvalidRow, ManifestRow, NotDownloaded
from . import files
from .lines import Raw
from .validate import Keys, option_keys, to_row

#: how a task reads a source: the records starting in its byte range of the source
RANGES = "ranges"
#: every k-th part (line, file or record batch) to task i of k; the source takes no room in the byte space
SPREAD = "spread"
#: all of it, by the one task whose range holds the source's first byte (placed by its size)
WHOLE = "whole"


@dataclass(frozen=True, slots=True)
class Part:
    """The part of a source a task reads: bytes [a, b) of the source's room in the byte space
    (`RANGES`), the parts n with n % k == i for `pick` = (i, k) (`SPREAD`), or all (`WHOLE`)."""

    a: int = 0
    b: int | None = None
    pick: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Source:
    """One input and its place in the tasks' virtual byte space; `meta` is an img2dataset
    shard's metadata Parquet, or for a missing source the file that lists it (None: a pattern)."""

    path: str  # absolute, or a URL
    fmt: Format
    start: int
    size: int  # bytes it occupies in the virtual space (0 for SPREAD formats)
    meta: str | None = None
    length: int = 0  # its own size in bytes, a spread source's too (progress)


#: (format, path, size in bytes, metadata file) of one source an input stands for
Planned = tuple["Format", str, int, "str | None"]
#: what a format's records are: rows of its own, or an img2dataset shard's rows not downloaded
Record = Raw | NotDownloaded | InvalidRow


class Format:
    """One input format. Subclasses set the attributes and override what differs from a
    manifest of JSON-like records: the defaults are keys `id`/`image`/`text`, media paths
    relative to the manifest's folder, records found by offset and kept as they are by retry.

    `rank` orders detection (lower first): a format that refines another (an img2dataset
    layout refines Parquet or a folder) ranks before it; a folder of files, which takes any
    folder, ranks last.
    """

    name: str = ""
    #: file names ending so are this format (lower case); none: it is not chosen by extension
    extensions: tuple[str, ...] = ()
    rank: int = 0
    slicing: str = WHOLE
    #: its records are found by key (`ManifestRow.key`, an error row's `key`), not by offset
    keyed: bool = False
    #: `errors retry` writes its records as JSONL rows under the option names (`id`, `image`, ...)
    rewritten: bool = False

    def expand(self, folder: str) -> list[Planned] | None:
        """The sources a folder stands for when it is of this format; None when it is not."""
        return None

    def recognizes(self, path: str, is_dir: bool) -> bool:
        """Whether an existing source named by an error row is of this format beyond its extension
        (a folder, an img2dataset shard); a file is otherwise told by its extension."""
        return False

    def taken_whole(self, src: Source) -> bool:
        """Whether one task reads all of `src` (the one whose range holds its first byte)."""
        return self.slicing == WHOLE

    def keys(self, cfg: ManifestConfig) -> Keys:
        """The keys of its records with the options given (`--id-key`, ... over the defaults)."""
        return option_keys(cfg, "id", ("image",), "text")

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        """This task's records of `src`: the `part` its `slicing` gives the task."""
        raise NotImplementedError(f"{self.name} inputs are read as the sources they hold")

    def spread_room(self, src: Source) -> int | None:
        """The bytes a task passes through in a spread source (`SPREAD`), for progress; None
        (the default) where that is unknown, and the task's slice then has no known size."""
        return None

    def position(self, src: Source, offset: int) -> int | None:
        """Where the record at `offset` starts in `src`'s room in the byte space, for progress;
        None where that is not known until the source ends (the default)."""
        return None

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """The record at `offset` (a keyed format's: at `key`, where given) and its read error;
        ManifestError when there is none."""
        raise NotImplementedError(f"{self.name} inputs are read as the sources they hold")

    def base_dir(self, path: str) -> str:
        """The folder relative media paths of its records start from."""
        return os.path.dirname(path)

    def key_of(self, record: dict[str, Any] | None) -> str | None:
        """A record's key where records are found by key (`keyed`), else None."""
        return None

    def row(self, path: str, line: int | None, offset: int, record: dict[str, Any] | None,
            error: MMError | None, keys: Keys) -> ManifestRow | InvalidRow:
        """One record validated into a row (or an invalid row) of the source at `path`."""
        return to_row(path, line, offset, record, error, keys, self.base_dir(path), self.key_of(record))


F = TypeVar("F", bound=Format)
_FORMATS: dict[str, Format] = {}


def register(fmt: F) -> F:
    """Add a format to the registry (its `name` and its extensions must be new, so that a file's
    format never depends on the order formats were registered in); returns it, for `X = register(X())`."""
    if not fmt.name or fmt.name in _FORMATS:
        raise ValueError(f"an input format needs a name of its own, not {fmt.name!r}")
    taken = {ext: other.name for other in _FORMATS.values() for ext in other.extensions}
    clash = [ext for ext in fmt.extensions if ext in taken]
    if clash:
        raise ValueError(f"input format {fmt.name}: {clash[0]} is already {taken[clash[0]]}'s extension")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister(fmt: Format) -> None:
    """Remove a registered format (a test's or a plugin's)."""
    if _FORMATS.get(fmt.name) is fmt:
        del _FORMATS[fmt.name]


def formats() -> list[Format]:
    """The registered formats in detection order (by rank, then as registered)."""
    return sorted(_FORMATS.values(), key=lambda f: f.rank)


def by_extension(path: str) -> Format:
    """The format of a file from its name (the longest extension that matches)."""
    name = os.path.basename(path.rstrip("/")).lower()
    found = [(len(ext), fmt) for fmt in formats() for ext in fmt.extensions if name.endswith(ext)]
    if found:
        return max(found, key=lambda e: e[0])[1]
    known = ", ".join(ext for fmt in formats() for ext in fmt.extensions)
    raise ManifestError(f"cannot tell the format of manifest {path!r} from its extension: use {known} "
                        "(or give a folder)")


def folder_sources(folder: str) -> list[Planned]:
    """The sources an existing folder stands for, from the first format that claims it."""
    for fmt in formats():
        found = fmt.expand(folder)
        if found is not None:
            return found
    raise ManifestError(f"no input format reads the folder {folder}")


def format_of(path: str) -> Format:
    """The format of the source an error row names (a file, a folder or a shard of an
    img2dataset output); ManifestError when it is gone or of no known format."""
    found = files.info(path)
    if not found.exists:
        raise ManifestError(f"manifest not found: {path}")
    for fmt in formats():
        if fmt.recognizes(path, found.is_dir):
            return fmt
    if found.is_dir:
        raise ManifestError(f"no input format reads the folder {path}")
    return by_extension(path)

