"""Reading an output's embeddings back without torch: `read_embeddings` (pooled vectors of a
modality as one matrix) and the token embeddings of `--pooling tokens` outputs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .fs import parquet_source
from .outdir import OutDir, open_output


def shard_meta(path: Path) -> dict[str, Any]:
    """The `mmenc` metadata recorded in a shard (Parquet schema metadata / safetensors header)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        with parquet_source(path) as source:
            raw = (pq.read_schema(source).metadata or {}).get(b"mmenc")
        return json.loads(raw) if raw else {}
    with path.open("rb") as fh:  # the safetensors header: 8 bytes of length, then JSON
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    raw = (header.get("__metadata__") or {}).get("mmenc")
    return json.loads(raw) if raw else {}


_NP_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}


def read_safetensors_np(path: Path, keys: Any = None) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file as numpy arrays without torch: float32/float16 as stored,
    bfloat16 widened to float32 exactly (a bfloat16 is the top half of a float32's bits).

    `safetensors.numpy` refuses bfloat16 since numpy has no such type; this reads the header
    (8-byte little-endian length + JSON) and the raw bytes itself.
    """
    with path.open("rb") as fh:  # a local path, or an object in a store
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
        base = 8 + size
        out: dict[str, np.ndarray] = {}
        wanted = [k for k in header if k != "__metadata__"] if keys is None else list(keys)
        for key in wanted:
            info = header[key]
            if info["dtype"] not in _NP_DTYPES:
                raise ValueError(f"{path.name}: tensor {key} has dtype {info['dtype']}, not a float type mmenc writes")
            start, end = info["data_offsets"]
            fh.seek(base + start)
            raw = np.frombuffer(fh.read(end - start), dtype=_NP_DTYPES[info["dtype"]]).reshape(info["shape"])
            if info["dtype"] == "BF16":
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            out[key] = raw
    return out


def read_shard(out: OutDir, path: Path, modality: str | None) -> tuple[list[str], list[str], np.ndarray]:
    """ids, modalities and a float32 matrix of one shard (rows of `modality` only when given)."""
    if is_token_shard(out, path):
        raise ValueError(f"{path.name} holds token embeddings ([tokens, dim] per item): read them with "
                         "read_token_embedding or iter_token_embeddings")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        with parquet_source(path) as source:
            table = pq.read_table(source, columns=["id", "modality", "embedding"])
        mods = table.column("modality").to_pylist()
        ids = table.column("id").to_pylist()
        emb = table.column("embedding").combine_chunks()
        dim = emb.type.list_size
        matrix = emb.values.to_numpy(zero_copy_only=False).reshape(-1, dim).astype(np.float32)
        if modality is not None:
            keep = np.array([m == modality for m in mods], dtype=bool)
            ids = [i for i, k in zip(ids, keep) if k]
            mods = [m for m, k in zip(mods, keep) if k]
            matrix = matrix[keep]
        return ids, mods, matrix
    import pyarrow.parquet as pq

    with parquet_source(out.sidecar_path(path.name)) as source:
        side = pq.read_table(source)
    ids = side.column("id").to_pylist()
    mods = side.column("modality").to_pylist()
    rows = side.column("row").to_pylist()
    tensors = {k: v.astype(np.float32, copy=False) for k, v in read_safetensors_np(path).items()}
    sel = [i for i, m in enumerate(mods) if modality is None or m == modality]
    if not sel:
        return [], [], np.zeros((0, 0), np.float32)
    matrix = np.stack([tensors[mods[i]][rows[i]] for i in sel])
    return [ids[i] for i in sel], [mods[i] for i in sel], matrix


def read_embeddings(out: "str | Path | OutDir", modality: str = "image",
                    storage_options: dict[str, str] | None = None) -> tuple[list[str], np.ndarray]:
    """Return (ids, float32 matrix [n, dim]) of one modality from a Parquet or safetensors output."""
    od = open_output(out, storage_options)
    all_ids: list[str] = []
    parts: list[np.ndarray] = []
    for shard in od.shards():
        ids, _, matrix = read_shard(od, shard, modality)
        if ids:
            all_ids.extend(ids)
            parts.append(matrix)
    if not parts:
        return [], np.zeros((0, 0), dtype=np.float32)
    return all_ids, np.concatenate(parts)


@dataclass
class TokenEmbedding:
    """One item of a `--pooling tokens` output: its `[tokens, dim]` array and `image_grid_thw`.

    `array` is numpy in the stored dtype (float16/float32; bfloat16 widened exactly to float32),
    or a torch tensor in the stored dtype when read with `framework="pt"`. `info` is the item's
    index row.
    """

    id: str
    modality: str
    array: Any
    grid: tuple[int, int, int] | None
    info: dict[str, Any]


def _token_index(od: OutDir, shard: Path) -> Path:
    return od.index_path(shard.name)


def is_token_shard(od: OutDir, shard: Path) -> bool:
    return shard.suffix == ".safetensors" and _token_index(od, shard).exists()


def check_token_shard(od: OutDir, shard: Path, facts: dict[str, Any]) -> tuple[list[str], list[str], int | None]:
    """Check a token shard against its index (keys, shapes, dtype) without loading tensors."""
    from safetensors import safe_open

    rows = _table(_token_index(od, shard)).to_pylist()
    dims = {r["dim"] for r in rows}
    if len(dims) > 1:
        raise ValueError(f"token dims differ within the shard: {sorted(dims)}")
    with od.fs.local_copy(shard) as local, safe_open(str(local), framework="numpy") as fh:
        keys = set(fh.keys())
        for r in rows:
            if r["key"] not in keys:
                raise ValueError(f"index row {r['id']!r} names missing tensor {r['key']}")
            shape = list(fh.get_slice(r["key"]).get_shape())
            if shape != [r["tokens"], r["dim"]]:
                raise ValueError(f"{r['key']} has shape {shape}, the index says [{r['tokens']}, {r['dim']}]")
    if len(keys) != len(rows):
        raise ValueError(f"{len(keys)} tensors but {len(rows)} index rows")
    return [r["id"] for r in rows], [r["modality"] for r in rows], (dims.pop() if dims else facts.get("dim"))


def _load_tensor(od: OutDir, shard: Path, key: str, framework: str) -> Any:
    if framework == "numpy":
        return read_safetensors_np(shard, [key])[key]
    from safetensors import safe_open

    with od.fs.local_copy(shard) as local, safe_open(str(local), framework=framework) as fh:
        return fh.get_tensor(key)


def _table(path: Any, columns: list[str] | None = None) -> Any:
    """A Parquet file (a local one or an object in a store) as an Arrow table."""
    import pyarrow.parquet as pq

    with parquet_source(path) as source:
        return pq.read_table(source, columns=columns)


def iter_token_embeddings(out: "str | Path | OutDir", modality: str | None = "image",
                          framework: str = "np") -> Iterator[TokenEmbedding]:
    """Every item of a `--pooling tokens` output, shard by shard (`framework`: "np" or "pt")."""
    fw = {"np": "numpy", "numpy": "numpy", "pt": "pt", "torch": "pt"}[framework]
    od = open_output(out)
    for shard in od.shards(".safetensors"):
        if not is_token_shard(od, shard):
            continue
        for row in _table(_token_index(od, shard)).to_pylist():
            if modality is not None and row["modality"] != modality:
                continue
            grid = row.get("image_grid_thw")
            yield TokenEmbedding(row["id"], row["modality"], _load_tensor(od, shard, row["key"], fw),
                                 tuple(int(x) for x in grid) if grid is not None else None, row)


def read_token_embedding(out: "str | Path | OutDir", id: str, modality: str = "image",
                         framework: str = "np") -> tuple[Any, tuple[int, int, int] | None]:
    """One item's `[tokens, dim]` array and its `image_grid_thw` (t, h, w); see TokenEmbedding.array.

    Raises KeyError when the output holds no such item.
    """
    import pyarrow.compute as pc

    fw = {"np": "numpy", "numpy": "numpy", "pt": "pt", "torch": "pt"}[framework]
    od = open_output(out)
    for shard in od.shards(".safetensors"):
        if not is_token_shard(od, shard):
            continue
        table = _table(_token_index(od, shard), ["id", "modality", "key", "image_grid_thw"])
        hit = table.filter(pc.and_(pc.equal(table["id"], id), pc.equal(table["modality"], modality)))
        if hit.num_rows:
            row = hit.to_pylist()[0]
            grid = row.get("image_grid_thw")
            return _load_tensor(od, shard, row["key"], fw), (tuple(int(x) for x in grid) if grid is not None else None)
    raise KeyError(f"no {modality} token embedding with id {id!r} in {od.root}")
