"""Manifest formats, told by extension (or, for folders, by what they hold), and each input's
place in the tasks' byte space."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ManifestError

_EXTENSIONS = (
    (".jsonl.gz", "jsonl.gz"), (".ndjson.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".ndjson", "jsonl"),
    (".csv", "csv"), (".tsv", "tsv"), (".parquet", "parquet"), (".tar", "tar"), (".tar.gz", "tar"),
    (".tgz", "tar"), (".arrow", "arrow"),
)
#: formats a task takes whole or not at all (placed by their first byte in the byte space)
WHOLE = frozenset({"tar", "i2d-files", "i2d-parquet", "i2d-missing", "missing"})
#: formats spread over all tasks row group by row group (n % k); they take no room in the byte space
SPREAD = frozenset({"jsonl.gz", "folder", "arrow"})


@dataclass(frozen=True, slots=True)
class Source:
    """One input and its place in the tasks' virtual byte space; `meta` is an img2dataset
    shard's metadata Parquet, or for a "missing" source the file that lists it (None: a pattern)."""

    path: str  # absolute, or a URL
    fmt: str
    start: int
    size: int  # bytes it occupies in the virtual space (0 for SPREAD formats)
    meta: str | None = None


def detect_format(path: str) -> str:
    """The manifest format of a file from its name: "jsonl", "jsonl.gz", "csv", "tsv", "parquet",
    "tar" or "arrow"."""
    name = os.path.basename(path.rstrip("/")).lower()
    for ext, fmt in _EXTENSIONS:
        if name.endswith(ext):
            return fmt
    raise ManifestError(f"cannot tell the format of manifest {path!r} from its extension: use .jsonl, "
                        ".ndjson, .jsonl.gz, .csv, .tsv, .parquet, .arrow or .tar (or give a folder)")
