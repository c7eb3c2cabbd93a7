"""The output folder: readers see only embeddings, shard names, metadata, inspect's checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmenc_cli.output import OutDir, parse_shard_name, shard_name
from mmenc_cli.run.pipeline import run_encode
from mmenc_cli.output.embeddings import read_embeddings
from mmenc_cli.output.inspect import inspect_output
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg


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
    # the widths are minimums: the millionth shard and task 100000 stay visible, in numeric order
    assert parse_shard_name(shard_name(123456, 100, 1_000_000, "parquet")) is not None
    assert parse_shard_name("part-t0012-w03-000007.parquet") is None
    meta = json.loads(pq.read_schema(shards[0]).metadata[b"mmenc"])
    for key in ("model", "revision", "dim", "dtype", "normalize", "pooling", "mmenc_version"):
        assert key in meta, key
    assert meta["dim"] == 8 and meta["model"] == "fake"


def test_the_float_column_is_written_without_a_dictionary(encoded: Path) -> None:
    """Strings (id, modality, kept fields) may be dictionary-encoded; the embedding floats never
    are (a dictionary of distinct floats only costs CPU)."""
    meta = pq.ParquetFile(OutDir(encoded).shards()[0]).metadata.row_group(0)
    encodings = {meta.column(i).path_in_schema: set(meta.column(i).encodings) for i in range(meta.num_columns)}
    dictionary = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}
    assert not encodings["embedding.list.element"] & dictionary, encodings
    assert encodings["modality"] & dictionary, encodings


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


@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
def test_safetensors_outputs_read_back_without_torch_in_every_dtype(tmp_path: Path, small_manifest: Path,
                                                                    out_dtype: str) -> None:
    """read_embeddings and inspect read bfloat16 safetensors too (widened exactly to float32),
    and agree with safetensors' own torch reader bit for bit."""
    import torch
    from safetensors.torch import load_file

    from mmenc_cli.config import RunConfig, WriterConfig

    out = tmp_path / "o"
    cfg = make_cfg([small_manifest], out)
    cfg = RunConfig(**{**cfg.__dict__, "writer": WriterConfig(out=str(out), format="safetensors", shard_size=5,
                                                              out_dtype=out_dtype)})
    run_encode(cfg, encoder_factory=factory(FakeEncoder()))
    ids, mat = read_embeddings(out, "image")
    assert mat.dtype == np.float32 and mat.shape == (8, 8)
    od = OutDir(out)
    want = []
    for shard in od.shards():
        tensors = load_file(str(shard))
        side = pq.read_table(od.sidecar_path(shard.name)).to_pylist()
        want += [tensors[r["modality"]][r["row"]].float().numpy() for r in side if r["modality"] == "image"]
        assert {t.dtype for t in tensors.values()} == {getattr(torch, out_dtype)}
    np.testing.assert_array_equal(mat, np.stack(want))
    rep = inspect_output(out)
    assert rep.problems == [] and rep.embeddings == 16
    # every sidecar went through the temp folder: nothing is left there
    assert not list((od.meta / "tmp").iterdir())


def test_a_millionth_shard_is_listed_in_order_and_numbered_after(tmp_path: Path) -> None:
    od = OutDir(tmp_path)
    for seq in (999_999, 1_000_000, 2):
        (tmp_path / shard_name(0, 0, seq, "parquet")).write_bytes(b"")
    assert [parse_shard_name(p.name).seq for p in od.shards()] == [2, 999_999, 1_000_000]
    assert od.next_seq(0, 0) == 1_000_001


def test_shard_logs_of_task_indexes_past_99999_are_read(tmp_path: Path) -> None:
    from mmenc_cli.output.shardlog import missing_shards, read_logs

    od = OutDir(tmp_path / "out")
    od.prepare()
    for task in (7, 123456):
        name = shard_name(task, 0, 0, "parquet")
        od.shard_log_path(task, 0).write_text(json.dumps({"name": name, "rows": 1, "bytes": 1}) + "\n")
    assert sorted(read_logs(od)) == [(7, 0), (123456, 0)]
    assert missing_shards(od) == [shard_name(7, 0, 0, "parquet"), shard_name(123456, 0, 0, "parquet")]
