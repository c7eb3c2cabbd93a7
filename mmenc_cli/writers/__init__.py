"""Shard writers: Parquet and safetensors, each committing a shard atomically through `OutDir`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..outdir import OutDir, fsync_dir, shard_name


@dataclass(slots=True)
class ShardData:
    """The rows of one shard: parallel lists plus a float32 matrix of embeddings."""

    ids: list[str] = field(default_factory=list)
    modalities: list[str] = field(default_factory=list)
    vectors: list[np.ndarray] = field(default_factory=list)
    keep: dict[str, list[Any]] = field(default_factory=dict)
    refs: list[Any] = field(default_factory=list)  # the ManifestRow of each embedding (for error rows)
    metas: list[dict[str, Any]] = field(default_factory=list)  # per-item facts (ImageInput.meta: grid, size)

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, id: str, modality: str, vector: np.ndarray, keep: dict[str, Any], ref: Any = None,
            meta: dict[str, Any] | None = None) -> None:
        """Append one embedding with its kept fields, its row (to report a failed write) and facts."""
        self.refs.append(ref)
        self.metas.append(meta or {})
        self.ids.append(id)
        self.modalities.append(modality)
        self.vectors.append(vector)
        for name, values in self.keep.items():
            values.append(keep.get(name))


def keep_value(value: Any) -> str | None:
    """Kept fields are stored as strings (non-strings JSON-encoded) so every shard has one schema."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return json.dumps(value, ensure_ascii=False, default=str)


class ShardWriter(Protocol):
    """Writes one shard under a temp name and commits it; returns the committed path."""

    ext: str

    def write(self, data: ShardData, name: str) -> Path: ...


def write_tmp(out: OutDir, name: str, writer_fn: Any) -> Path:
    """Run `writer_fn(tmp_path)`, fsync the file, and return the temp path (not yet committed)."""
    tmp = out.tmp_path(name)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer_fn(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_side_file(out: OutDir, final: Path, writer_fn: Any) -> Path:
    """Write a file that travels with a shard (sidecar, token index) through a fsynced temp file
    and an atomic rename, before the shard itself is committed: a crash leaves either no file or
    a whole one, never a torn Parquet footer that a reader would trip on."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = write_tmp(out, final.parent.name + "-" + final.name, writer_fn)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def make_writer(fmt: str, out: OutDir, meta: dict[str, Any], out_dtype: str, keep: tuple[str, ...]) -> ShardWriter:
    """The writer for `--format` (token shards + index when the encoder's output_kind is tokens)."""
    if meta.get("output_kind") == "tokens":
        from .tokens import TokenShardWriter

        return TokenShardWriter(out, meta, out_dtype, keep)
    if fmt == "parquet":
        from .parquet import ParquetShardWriter

        return ParquetShardWriter(out, meta, out_dtype, keep)
    from .safetensors import SafetensorsShardWriter

    return SafetensorsShardWriter(out, meta, out_dtype, keep)


__all__ = ["ShardData", "ShardWriter", "make_writer", "shard_name", "keep_value", "write_tmp"]
