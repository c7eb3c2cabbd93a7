"""Manifest formats, told by extension, and each manifest's place in the tasks' byte space."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ManifestError

_EXTENSIONS = (
    (".jsonl.gz", "jsonl.gz"), (".ndjson.gz", "jsonl.gz"), (".jsonl", "jsonl"), (".ndjson", "jsonl"),
    (".csv", "csv"), (".tsv", "tsv"), (".parquet", "parquet"),
)


@dataclass(frozen=True, slots=True)
class Source:
    """One manifest and its place in the tasks' virtual byte space."""

    path: str  # absolute
    fmt: str
    start: int
    size: int  # bytes it occupies in the virtual space (0 for .gz)


def detect_format(path: str) -> str:
    """The manifest format from the file name: "jsonl", "jsonl.gz", "csv", "tsv" or "parquet"."""
    name = os.path.basename(path).lower()
    for ext, fmt in _EXTENSIONS:
        if name.endswith(ext):
            return fmt
    raise ManifestError(f"cannot tell the format of manifest {path!r} from its extension: "
                        "use .jsonl, .ndjson, .jsonl.gz, .csv, .tsv or .parquet")
