"""safetensors shards: one 2-D tensor per modality, ids and kept fields in a Parquet sidecar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from . import ShardData, ShardFiles, keep_value


class SafetensorsShardWriter:
    """Tensors `image` / `text` of shape [n, dim]; the sidecar under `_mmenc/sidecars/` maps rows.

    The sidecar (columns `id`, `modality`, `row`, kept fields) is written first; the shard's
    rename commits both, and a sidecar without its shard is removed when its task restarts.
    """

    ext = "safetensors"

    def __init__(self, meta: dict[str, Any], out_dtype: str, keep: tuple[str, ...]) -> None:
        self.out_dtype = out_dtype
        self.keep = keep
        self.meta = {"mmenc": json.dumps(meta, sort_keys=True)}

    def files(self, data: ShardData, name: str) -> ShardFiles:
        """The tensors and their sidecar."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows: list[int] = []
        per_mod: dict[str, list[np.ndarray]] = {}
        for modality, vector in zip(data.modalities, data.vectors):
            bucket = per_mod.setdefault(modality, [])
            rows.append(len(bucket))
            bucket.append(vector)
        tensors = {m: np.ascontiguousarray(np.stack(v).astype(np.float32, copy=False)) for m, v in per_mod.items()}
        side = {"id": pa.array(data.ids, pa.string()), "modality": pa.array(data.modalities, pa.string()),
                "row": pa.array(rows, pa.int64())}
        side.update({k: pa.array([keep_value(v) for v in data.keep[k]], pa.string()) for k in self.keep})
        return ShardFiles(lambda p: save_tensors(tensors, p, self.out_dtype, self.meta),
                          sidecar=lambda p: pq.write_table(pa.table(side), p))


def save_tensors(tensors: dict[str, np.ndarray], path: Path, out_dtype: str, meta: dict[str, str]) -> None:
    """Save float32 arrays as float32/float16 with numpy, or bfloat16 through torch."""
    if out_dtype == "bfloat16":
        import torch
        from safetensors.torch import save_file as save_torch

        save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()}, str(path), metadata=meta)
        return
    from safetensors.numpy import save_file

    dtype = np.float16 if out_dtype == "float16" else np.float32
    save_file({k: v.astype(dtype) for k, v in tensors.items()}, str(path), metadata=meta)
