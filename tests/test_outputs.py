"""The output folder: readers see only embeddings, shard names, metadata, inspect's checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmenc_cli.outdir import OutDir, parse_shard_name, shard_name
from mmenc_cli.pipeline import run_encode
from mmenc_cli.reader import inspect_output, read_embeddings
from tests.fakes import FakeEncoder, factory
from tests.test_pipeline import make_cfg


@pytest.fixture
def encoded(tmp_path: Path, small_manifest: Path) -> Path:
    out = tmp_path / "out"
    run_encode(make_cfg([small_manifest], out, keep=["label"], shard_size=5), encoder_factory=factory(FakeEncoder()))
    # a leftover temp file of a killed run must stay invisible to readers
    (OutDir(out).meta / "tmp" / ".part-t00000-w00-000099.parquet.tmp").write_bytes(b"partial")
    return out


def test_readers_see_exactly_the_embeddings(encoded: Path) -> None:
    import duckdb
    import pandas as pd
    import pyarrow.dataset as ds

    table = ds.dataset(encoded, format="parquet").to_table()
    assert table.num_rows == 16
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 8)
    assert table.schema.field("id").type == pa.string() and table.schema.field("modality").type == pa.string()
    df = pd.read_parquet(encoded)
    assert len(df) == 16 and set(df.modality) == {"image", "text"}
    n = duckdb.sql(f"select count(*) from read_parquet('{encoded}/*.parquet')").fetchall()[0][0]
    assert n == 16
    assert set(df.columns) == {"id", "modality", "embedding", "label"}


def test_shard_names_and_schema_metadata(encoded: Path) -> None:
    shards = OutDir(encoded).shards()
    assert [p.name for p in shards] == [shard_name(0, 0, i, "parquet") for i in range(4)]
    assert parse_shard_name("part-t00012-w03-000007.parquet").task == 12
    meta = json.loads(pq.read_schema(shards[0]).metadata[b"mmenc"])
    for key in ("model", "revision", "dim", "dtype", "normalize", "pooling", "mmenc_version"):
        assert key in meta, key
    assert meta["dim"] == 8 and meta["model"] == "fake"


def test_read_embeddings_returns_float32_matrix(encoded: Path) -> None:
    ids, mat = read_embeddings(encoded, "text")
    assert mat.dtype == np.float32 and mat.shape == (8, 8) and len(set(ids)) == 8


def test_inspect_ok_then_truncated_and_wrong_dim_shards_are_named(encoded: Path) -> None:
    rep = inspect_output(encoded)
    assert rep.problems == [] and rep.embeddings == 16 and rep.by_modality == {"image": 8, "text": 8}
    shards = OutDir(encoded).shards()
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    bad_dim = pa.table({"id": ["z"], "modality": ["text"],
                        "embedding": pa.FixedSizeListArray.from_arrays(pa.array([0.0] * 4, pa.float32()), 4)})
    pq.write_table(bad_dim, encoded / shard_name(5, 0, 0, "parquet"))
    rep = inspect_output(encoded)
    assert len(rep.problems) == 2
    assert shards[1].name in rep.problems[0] and "part-t00005" in rep.problems[1] and "dim 4" in rep.problems[1]


def test_out_dtype_float16(tmp_path: Path, small_manifest: Path) -> None:
    from mmenc_cli.config import RunConfig, WriterConfig

    cfg = make_cfg([small_manifest], tmp_path / "o")
    cfg = RunConfig(**{**cfg.__dict__, "writer": WriterConfig(out=str(tmp_path / "o"), out_dtype="float16")})
    run_encode(cfg, encoder_factory=factory(FakeEncoder()))
    schema = pq.read_schema(OutDir(tmp_path / "o").shards()[0])
    assert schema.field("embedding").type == pa.list_(pa.float16(), 8)
    ids, mat = read_embeddings(tmp_path / "o", "image")
    assert mat.dtype == np.float32 and len(ids) == 8
