"""Token shards (`--pooling tokens`): one `[tokens, dim]` tensor per item, indexed by a Parquet file.

Shard `part-....safetensors` at the top of OUT holds tensors `emb.0`, `emb.1`, ... (float16 by
default, float32, or bfloat16, which only torch reads), with the run's facts in its header under
`mmenc`. Its index (`OutDir.index_path`) has one row per tensor (`INDEX_COLUMNS`, then the kept
fields as strings). The output writes the index first; the shard's commit makes both count, and
an index whose shard never got committed is removed when its task restarts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from . import ShardData, ShardFiles, keep_value

#: index columns, in order (kept fields follow)
INDEX_COLUMNS = ("id", "modality", "shard", "key", "tokens", "dim", "dtype", "image_grid_thw",
                 "orig_width", "orig_height", "min_pixels", "max_pixels", "frame_seconds")


def tensor_key(row: int) -> str:
    """The tensor name of the `row`-th item of a token shard."""
    return f"emb.{row}"


class TokenShardWriter:
    """Writes token shards and their Parquet index (see the module docstring)."""

    ext = "safetensors"

    def __init__(self, meta: dict[str, Any], out_dtype: str, keep: tuple[str, ...]) -> None:
        self.out_dtype = out_dtype
        self.dim = int(meta["dim"])
        self.keep = keep
        self.meta = {"mmenc": json.dumps(meta, sort_keys=True), "mmenc_layout": "tokens"}

    def index_table(self, data: ShardData, name: str) -> Any:
        """The Arrow table indexing one shard."""
        import pyarrow as pa

        metas = data.metas
        grids = [_grid(m) for m in metas]
        sizes = [tuple(m.get("orig_size") or (None, None)) for m in metas]
        columns: dict[str, Any] = {
            "id": pa.array(data.ids, pa.string()),
            "modality": pa.array(data.modalities, pa.string()),
            "shard": pa.array([name] * len(data), pa.string()),
            "key": pa.array([tensor_key(i) for i in range(len(data))], pa.string()),
            "tokens": pa.array([int(v.shape[0]) for v in data.vectors], pa.int64()),
            "dim": pa.array([int(v.shape[1]) for v in data.vectors], pa.int32()),
            "dtype": pa.array([self.out_dtype] * len(data), pa.string()),
            "image_grid_thw": pa.array(grids, pa.list_(pa.int32(), 3)),
            "orig_width": pa.array([s[0] for s in sizes], pa.int32()),
            "orig_height": pa.array([s[1] for s in sizes], pa.int32()),
            "min_pixels": pa.array([m.get("min_pixels") for m in metas], pa.int64()),
            "max_pixels": pa.array([m.get("max_pixels") for m in metas], pa.int64()),
            # a video clip's seconds between sampled frames (its temporal positions; null for images)
            "frame_seconds": pa.array([m.get("frame_step") for m in metas], pa.float64()),
        }
        columns.update({k: pa.array([keep_value(v) for v in data.keep[k]], pa.string()) for k in self.keep})
        return pa.table(columns)

    def files(self, data: ShardData, name: str) -> ShardFiles:
        """The tensors and their index (ValueError for a tensor of the wrong shape)."""
        import pyarrow.parquet as pq

        from .safetensors_shards import save_tensors

        for v in data.vectors:
            if v.ndim != 2 or v.shape[1] != self.dim:
                raise ValueError(f"token embedding of shape {v.shape}, expected [tokens, {self.dim}]")
        table = self.index_table(data, name)
        tensors = {tensor_key(i): np.ascontiguousarray(v, dtype=np.float32) for i, v in enumerate(data.vectors)}
        return ShardFiles(lambda p: save_tensors(tensors, p, self.out_dtype, self.meta),
                          index=lambda p: pq.write_table(table, p))


def _grid(meta: dict[str, Any]) -> list[int] | None:
    """An image's `image_grid_thw` or a video clip's `video_grid_thw` (both in the index's
    `image_grid_thw` column; the `modality` column tells them apart)."""
    grid = meta.get("image_grid_thw") or meta.get("video_grid_thw")
    return [int(x) for x in grid] if grid is not None else None
