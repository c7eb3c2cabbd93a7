"""Typed records passed between the pipeline's stages (never dicts with magic keys)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .clock import timestamp
from .errors import MMError, trim_message

#: media decoded in the worker processes (images, audio clips, video clips)
MEDIA = ("image", "audio", "video")
MODALITIES = ("image", "text", "audio", "video")


@dataclass(slots=True)
class ManifestRow:
    """One valid manifest row.

    `image`, `audio` and `video` are what the manifest holds for each medium: a str (path,
    file://, http(s)://, data: URI) or bytes (Parquet inline bytes); relative paths are resolved
    against `base_dir` by the media stage. `keep` holds the fields named with --keep. `offset` is the byte offset of the row in a
    JSONL/CSV manifest or the row index in a Parquet one; `line` is 1-based where known. `key` names
    the row in an input whose order can change (a folder's sample: its relative path); `locator`
    is what identifies the row in its input from one run to the next.
    """

    id: str
    manifest: str
    line: int | None
    offset: int | None
    image: str | bytes | None = None
    text: str | None = None
    keep: dict[str, Any] = field(default_factory=dict)
    base_dir: str = "."
    audio: str | bytes | None = None
    video: str | bytes | None = None
    key: str | None = None

    @property
    def locator(self) -> str:
        """The row's stable place in its input: its `key`, else its offset."""
        return self.key if self.key is not None else str(self.offset)

    def value(self, modality: str) -> str | bytes | None:
        """What the row holds for `modality` (None: nothing, the item is skipped)."""
        if modality == "text":
            return self.text
        return self.image if modality == "image" else self.audio if modality == "audio" else self.video


@dataclass(slots=True)
class InvalidRow:
    """A manifest line that is not a valid row: it becomes one error row with modality null."""

    manifest: str
    line: int | None
    offset: int | None
    error: MMError
    id: str | None = None
    key: str | None = None

    @property
    def locator(self) -> str:
        """The line's stable place in its input (as `ManifestRow.locator`)."""
        return self.key if self.key is not None else str(self.offset)


@dataclass(slots=True)
class NotDownloaded:
    """A row of an img2dataset shard's metadata whose download failed: counted apart, not encoded."""

    manifest: str
    offset: int
    id: str | None
    status: str | None
    message: str | None = None


class Released(str):
    """What a row holds for a medium once its inline bytes were left to the item that encodes them:
    what the error report shows for them (`<N bytes inline>`), never a source to load."""

    __slots__ = ()


@dataclass(slots=True)
class Item:
    """One (row, modality) to encode; `cut`: its text was cut before tokenizing (counted as truncated).

    `source` is what a medium is loaded from (path, URL or inline bytes) until the item is sent to
    the decode workers, then None; `row` holds no inline bytes (`Released` in their place), so what
    waits for its batch and its shard never keeps a payload alive (memory bounded by items in
    flight, not by the shard size).
    """

    row: ManifestRow
    modality: str
    cut: bool = False
    source: str | bytes | None = None


@dataclass(slots=True)
class ErrorRecord:
    """One row of the error report. `offset` is what `mmenc errors retry` uses to find the row."""

    id: str | None
    manifest: str | None
    line: int | None
    offset: int | None
    modality: str | None
    stage: str
    code: int
    reason: str
    error: str
    message: str
    source: str | None = None
    attempt: int = 1
    time: str = field(default_factory=timestamp)
    task: int = 0
    status: str = "failed"  # "failed", or "resolved": a marker that a manifest line invalid before is a row now
    key: str | None = None  # a folder's sample: its relative path (its offset is its place in the walk, which moves)

    @classmethod
    def from_error(cls, err: MMError, *, id: str | None, manifest: str | None, line: int | None,
                   offset: int | None, modality: str | None, source: str | None = None,
                   attempt: int = 1, task: int = 0, key: str | None = None) -> "ErrorRecord":
        """Build a report row from an `MMError` and where the item came from."""
        return cls(id=id, manifest=manifest, line=line, offset=offset, modality=modality,
                   stage=err.stage, code=err.code, reason=err.reason, error=err.error,
                   message=trim_message(err.message), source=source, attempt=attempt, task=task, key=key)

    @classmethod
    def resolved(cls, *, id: str, manifest: str, line: int | None, offset: int | None, task: int,
                 key: str | None = None) -> "ErrorRecord":
        """A marker: the manifest line at (manifest, offset or key), invalid in an earlier run, is a
        valid row now; the errors commands no longer count the earlier failure."""
        return cls(id=id, manifest=manifest, line=line, offset=offset, modality=None, stage="read", code=0,
                   reason="resolved", error="", message="this manifest line is a valid row now", task=task,
                   status="resolved", key=key)

    def to_json(self) -> str:
        """One JSON line (no trailing newline)."""
        return json.dumps(asdict(self))  # ASCII: lone surrogates round-trip
