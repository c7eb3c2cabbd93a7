"""From the inputs given to the sources read: patterns expanded, folders told apart (a folder of
files, a saved dataset, an img2dataset output), each source placed in the tasks' byte space.

A path given as it is must exist (a usage error otherwise, before anything runs); a name a brace
range or glob produced that is missing, a data file a saved dataset lists that is missing, and an
img2dataset shard whose samples are missing each become one error row and the run goes on.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ManifestError
from . import files
from .missing import MISSING
from .registry import SPREAD, Planned, Source, by_extension, folder_sources


def plan(inputs: Sequence[str]) -> list[Source]:
    """Check every input and lay its sources out in the virtual byte space."""
    sources: list[Source] = []
    for given in inputs:
        for path, from_pattern in files.expand(given):
            for fmt, source, size, meta in _sources(given, path, from_pattern):
                start = sources[-1].start + sources[-1].size if sources else 0
                sources.append(Source(source, fmt, start, 0 if fmt.slicing == SPREAD else size, meta, size))
    return sources


def _sources(given: str, path: str, from_pattern: bool) -> list[Planned]:
    """(format, path, size, metadata) of the sources of one existing or pattern-made path: a file
    by its extension, a folder by what it holds (`registry.folder_sources`); a missing name takes
    no room (its one error row goes to the task at its place)."""
    found = files.info(path)
    if not found.exists:
        if from_pattern:
            return [(MISSING, path, 0, None)]
        raise ManifestError(f"manifest not found: {given}")
    if not found.is_dir:
        return [(by_extension(path), path, found.size, None)]
    return folder_sources(path)
