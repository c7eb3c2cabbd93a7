"""Shard writers: Parquet, safetensors and token shards. A writer turns a shard's rows into the
functions that write its files; the output (`output/task.py`) writes them, side files first, and
commits the shard."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

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


@dataclass(frozen=True, slots=True)
class ShardFiles:
    """What a writer makes of one shard: the function that writes the shard file at a path it is
    given, and those of its side files (a safetensors shard's sidecar, a token shard's index),
    which the output writes first: the shard's own commit makes them count."""

    shard: Callable[[Path], None]
    sidecar: Callable[[Path], None] | None = None
    index: Callable[[Path], None] | None = None


class ShardWriter(Protocol):
    """Encodes a shard's rows into its files (`ShardFiles`); where they go is the output's business."""

    ext: str

    def files(self, data: ShardData, name: str) -> ShardFiles: ...


def make_writer(fmt: str, meta: dict[str, Any], out_dtype: str, keep: tuple[str, ...]) -> ShardWriter:
    """The writer for `--format` (token shards + index when the encoder's output_kind is tokens)."""
    if meta.get("output_kind") == "tokens":
        from .token_shards import TokenShardWriter

        return TokenShardWriter(meta, out_dtype, keep)
    if fmt == "parquet":
        from .parquet_shards import ParquetShardWriter

        return ParquetShardWriter(meta, out_dtype, keep)
    from .safetensors_shards import SafetensorsShardWriter

    return SafetensorsShardWriter(meta, out_dtype, keep)


__all__ = ["ShardData", "ShardFiles", "ShardWriter", "keep_value", "make_writer"]
