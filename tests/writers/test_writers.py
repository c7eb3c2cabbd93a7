"""Unit tests of `mmenc_cli.writers`: Parquet, safetensors and token shards, and atomic commits.

Every test writes into a fresh `OutDir` under `tmp_path` and reads the files back with pyarrow,
safetensors or `mmenc_cli.reader.read_safetensors_np`, never with the writer's own code.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from mmenc_cli.errors import OutputError
from mmenc_cli.output import OutDir, shard_name
from mmenc_cli.output.embeddings import read_safetensors_np
from mmenc_cli.writers import ShardData, ShardWriter, keep_value, make_writer
from mmenc_cli.writers.parquet_shards import ParquetShardWriter
from mmenc_cli.writers.safetensors_shards import SafetensorsShardWriter
from mmenc_cli.writers.token_shards import INDEX_COLUMNS, TokenShardWriter

DIM = 4
META = {"dim": DIM, "model": "m", "output_kind": "pooled", "normalize": True}
TOKEN_META = {"dim": DIM, "model": "m", "output_kind": "tokens"}
PARQUET = shard_name(0, 0, 0, "parquet")
SAFETENSORS = shard_name(0, 0, 0, "safetensors")


def commit(out: OutDir, writer: ShardWriter, data: ShardData, name: str) -> Path:
    """Write one shard's files and commit it, as a task's output does."""
    return out.publish_shard_files(name, writer.files(data, name))


@pytest.fixture
def out(tmp_path: Path) -> OutDir:
    od = OutDir(tmp_path / "OUT")
    od.prepare()
    return od


def tmp_files(out: OutDir) -> list[str]:
    """What is left in `_mmenc/tmp`."""
    return sorted(p.name for p in (out.meta / "tmp").iterdir())


def top_files(out: OutDir) -> list[str]:
    """Plain files at the top of OUT."""
    return sorted(p.name for p in out.root.iterdir() if p.is_file())


def vector(i: int, dim: int = DIM) -> np.ndarray:
    """A float32 vector with values that float16/bfloat16 cannot all hold exactly."""
    return (np.arange(dim, dtype=np.float32) + 1) / 3 + i


def shard(items: list[tuple[str, str, dict[str, Any]]], keep: tuple[str, ...] = (),
          dim: int = DIM) -> ShardData:
    """ShardData of (id, modality, kept values); the i-th item's vector is `vector(i, dim)`."""
    data = ShardData(keep={k: [] for k in keep})
    for i, (id_, modality, kept) in enumerate(items):
        data.add(id_, modality, vector(i, dim), kept)
    return data


# -- keep_value / ShardData -----------------------------------------------------------------------

@pytest.mark.parametrize("value, stored", [
    (None, None),
    ("text", "text"),
    ("", ""),
    (3, "3"),
    (2.5, "2.5"),
    (True, "true"),
    ([1, "a"], '[1, "a"]'),
    ({"k": "café"}, '{"k": "café"}'),  # not ASCII-escaped
    (b"\x00\x01\x02", "<3 bytes>"),
    (datetime.date(2024, 1, 2), '"2024-01-02"'),  # non-JSON values through str()
])
def test_keep_value(value: Any, stored: str | None) -> None:
    assert keep_value(value) == stored


def test_shard_data_add() -> None:
    data = ShardData(keep={"a": [], "b": []})
    data.add("x", "image", vector(0), {"a": 1}, ref="row-x", meta={"orig_size": (3, 4)})
    data.add("y", "text", vector(1), {"a": 2, "b": "B", "ignored": 0})
    assert len(data) == 2
    assert data.ids == ["x", "y"] and data.modalities == ["image", "text"]
    assert data.keep == {"a": [1, 2], "b": [None, "B"]}  # a field missing from a row is None
    assert data.refs == ["row-x", None]
    assert data.metas == [{"orig_size": (3, 4)}, {}]


def test_make_writer_picks_the_writer(out: OutDir) -> None:
    assert isinstance(make_writer("parquet", META, "float32", ()), ParquetShardWriter)
    assert isinstance(make_writer("safetensors", META, "float32", ()), SafetensorsShardWriter)
    for fmt in ("parquet", "safetensors"):  # token outputs always go to token shards
        w = make_writer(fmt, TOKEN_META, "float16", ())
        assert isinstance(w, TokenShardWriter) and w.ext == "safetensors"
    assert make_writer("parquet", META, "float32", ()).ext == "parquet"
    assert make_writer("safetensors", META, "float32", ()).ext == "safetensors"


# -- Parquet --------------------------------------------------------------------------------------

def test_parquet_schema_values_and_metadata(out: OutDir) -> None:
    keep = ("label", "extra", "blob", "missing")
    data = shard([("a", "image", {"label": "cat", "extra": {"n": 1}, "blob": b"abcd"}),
                  ("b", "text", {"label": 7, "extra": [1, 2], "blob": None}),
                  ("c", "image", {"label": None, "extra": "plain", "blob": b""})], keep)
    writer = make_writer("parquet", META, "float32", keep)
    path = commit(out, writer, data, PARQUET)

    assert path == out.root / PARQUET
    assert top_files(out) == [PARQUET]
    assert tmp_files(out) == []

    schema = pq.read_schema(path)
    assert schema.names == ["id", "modality", "embedding", *keep]
    assert schema.field("id").type == pa.string() and not schema.field("id").nullable
    assert schema.field("modality").type == pa.string()
    assert schema.field("embedding").type == pa.list_(pa.float32(), DIM)
    assert all(schema.field(k).type == pa.string() for k in keep)
    assert json.loads(schema.metadata[b"mmenc"]) == META

    table = pq.read_table(path)
    assert table.column("id").to_pylist() == ["a", "b", "c"]
    assert table.column("modality").to_pylist() == ["image", "text", "image"]
    assert table.column("label").to_pylist() == ["cat", "7", None]
    assert table.column("extra").to_pylist() == ['{"n": 1}', "[1, 2]", "plain"]
    assert table.column("blob").to_pylist() == ["<4 bytes>", None, "<0 bytes>"]
    assert table.column("missing").to_pylist() == [None, None, None]
    emb = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    np.testing.assert_array_equal(emb, np.stack([vector(i) for i in range(3)]))


def test_parquet_float16(out: OutDir) -> None:
    data = shard([("a", "text", {}), ("b", "text", {})])
    path = commit(out, make_writer("parquet", META, "float16", ()), data, PARQUET)
    schema = pq.read_schema(path)
    assert schema.field("embedding").type == pa.list_(pa.float16(), DIM)
    values = pq.read_table(path).column("embedding").combine_chunks().values.to_numpy(zero_copy_only=False)
    assert values.dtype == np.float16
    np.testing.assert_array_equal(values.reshape(2, DIM), np.stack([vector(0), vector(1)]).astype(np.float16))


def test_parquet_without_kept_fields(out: OutDir) -> None:
    path = commit(out, make_writer("parquet", META, "float32", ()), shard([("only", "image", {"x": 1})]), PARQUET)
    assert pq.read_schema(path).names == ["id", "modality", "embedding"]
    assert pq.read_table(path).num_rows == 1


def test_parquet_failed_write_leaves_nothing(out: OutDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file exists when the write fails: neither it nor a shard may survive."""
    made: list[Path] = []

    def broken_write_table(table: Any, where: Any, **kwargs: Any) -> None:
        Path(where).write_bytes(b"PAR1 half a footer")
        made.append(Path(where))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", broken_write_table)
    writer = make_writer("parquet", META, "float32", ())
    with pytest.raises(OSError, match="No space left"):
        commit(out, writer, shard([("a", "image", {})]), PARQUET)
    assert made and made[0].parent == out.meta / "tmp"  # the temp file was really created
    assert not made[0].exists()
    assert top_files(out) == []
    assert tmp_files(out) == []
    assert out.shards() == []


def test_commit_of_an_existing_name_raises(out: OutDir) -> None:
    writer = make_writer("parquet", META, "float32", ())
    commit(out, writer, shard([("first", "image", {})]), PARQUET)
    with pytest.raises(OutputError, match="already exists"):
        commit(out, writer, shard([("second", "image", {})]), PARQUET)
    assert pq.read_table(out.root / PARQUET).column("id").to_pylist() == ["first"]  # untouched
    assert OutputError.exit_code == 3


# -- safetensors ---------------------------------------------------------------------------------

MIXED = [("t0", "text", {"lab": "x"}), ("i0", "image", {"lab": 1}), ("t1", "text", {}),
         ("i1", "image", {"lab": [2]}), ("t2", "text", {"lab": None})]


def test_safetensors_tensors_and_sidecar(out: OutDir) -> None:
    data = shard(MIXED, keep=("lab",))
    path = commit(out, make_writer("safetensors", META, "float32", ("lab",)), data, SAFETENSORS)

    assert path == out.root / SAFETENSORS
    assert top_files(out) == [SAFETENSORS]
    assert tmp_files(out) == []
    side_path = out.meta / "sidecars" / "part-t00000-w00-000000.pq"
    assert side_path.exists()
    side = pq.read_table(side_path)
    assert side.column_names == ["id", "modality", "row", "lab"]
    assert side.schema.field("row").type == pa.int64()
    assert side.column("id").to_pylist() == ["t0", "i0", "t1", "i1", "t2"]
    assert side.column("modality").to_pylist() == ["text", "image", "text", "image", "text"]
    assert side.column("row").to_pylist() == [0, 0, 1, 1, 2]
    assert side.column("lab").to_pylist() == ["x", "1", None, "[2]", None]

    tensors = read_safetensors_np(path)
    assert sorted(tensors) == ["image", "text"]
    assert tensors["text"].shape == (3, DIM) and tensors["image"].shape == (2, DIM)
    assert tensors["text"].dtype == np.float32
    for i, (mod, row) in enumerate(zip(side.column("modality").to_pylist(), side.column("row").to_pylist())):
        np.testing.assert_array_equal(tensors[mod][row], vector(i))

    with safe_open(str(path), framework="numpy") as fh:
        assert json.loads(fh.metadata()["mmenc"]) == META


def test_safetensors_single_modality(out: OutDir) -> None:
    path = commit(out, make_writer("safetensors", META, "float32", ()), shard([("a", "image", {}), ("b", "image", {})]), SAFETENSORS)
    tensors = read_safetensors_np(path)
    assert list(tensors) == ["image"] and tensors["image"].shape == (2, DIM)


def test_safetensors_float16(out: OutDir) -> None:
    path = commit(out, make_writer("safetensors", META, "float16", ()), shard(MIXED[:3]), SAFETENSORS)
    tensors = read_safetensors_np(path)
    assert tensors["text"].dtype == np.float16
    np.testing.assert_array_equal(tensors["text"], np.stack([vector(0), vector(2)]).astype(np.float16))
    np.testing.assert_array_equal(tensors["image"], vector(1)[None].astype(np.float16))


def test_safetensors_bfloat16(out: OutDir) -> None:
    path = commit(out, make_writer("safetensors", META, "bfloat16", ()), shard(MIXED), SAFETENSORS)
    with open(path, "rb") as fh:  # really stored as bfloat16
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    assert header["text"]["dtype"] == "BF16" and header["image"]["dtype"] == "BF16"

    tensors = read_safetensors_np(path)
    text = np.stack([vector(0), vector(2), vector(4)])
    expected = torch.from_numpy(text).to(torch.bfloat16).float().numpy()
    assert tensors["text"].dtype == np.float32
    np.testing.assert_array_equal(tensors["text"], expected)
    assert not np.array_equal(tensors["text"], text)  # the rounding really happened


def test_safetensors_commit_of_an_existing_name_raises(out: OutDir) -> None:
    writer = make_writer("safetensors", META, "float32", ())
    commit(out, writer, shard([("first", "image", {})]), SAFETENSORS)
    with pytest.raises(OutputError, match="already exists"):
        commit(out, writer, shard([("second", "text", {})]), SAFETENSORS)
    assert list(read_safetensors_np(out.root / SAFETENSORS)) == ["image"]


def test_safetensors_refused_commit_keeps_the_existing_sidecar(out: OutDir) -> None:
    """A shard name already taken must leave the committed shard's sidecar alone (its ids)."""
    writer = make_writer("safetensors", META, "float32", ())
    commit(out, writer, shard([("first", "image", {})]), SAFETENSORS)
    with pytest.raises(OutputError):
        commit(out, writer, shard([("second", "text", {})]), SAFETENSORS)
    assert pq.read_table(out.sidecar_path(SAFETENSORS)).column("id").to_pylist() == ["first"]


# -- token shards --------------------------------------------------------------------------------

def token_data(keep: tuple[str, ...] = ("lab",)) -> ShardData:
    """An image of 6 tokens with a grid and sizes, a text of 3 tokens without, an image of 1 token."""
    data = ShardData(keep={k: [] for k in keep})
    data.add("img", "image", np.arange(6 * DIM, dtype=np.float32).reshape(6, DIM) / 7, {"lab": "a"},
             meta={"image_grid_thw": (1, 2, 3), "orig_size": (640, 480), "min_pixels": 100, "max_pixels": 9000})
    data.add("txt", "text", np.ones((3, DIM), np.float32), {"lab": 5})
    data.add("img2", "image", np.full((1, DIM), -2.5, np.float32), {},
             meta={"image_grid_thw": [1, 1, 1], "orig_size": (8, 9)})
    return data


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_token_shard_and_index(out: OutDir, dtype: str) -> None:
    data = token_data()
    writer = make_writer("safetensors", TOKEN_META, dtype, ("lab",))
    path = commit(out, writer, data, SAFETENSORS)

    assert path == out.root / SAFETENSORS
    assert top_files(out) == [SAFETENSORS]
    assert tmp_files(out) == []

    tensors = read_safetensors_np(path)
    assert sorted(tensors) == ["emb.0", "emb.1", "emb.2"]
    assert [tensors[f"emb.{i}"].shape for i in range(3)] == [(6, DIM), (3, DIM), (1, DIM)]
    for i, v in enumerate(data.vectors):
        if dtype == "bfloat16":
            expected = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
        else:
            expected = v.astype(dtype)
        np.testing.assert_array_equal(tensors[f"emb.{i}"], expected)

    with safe_open(str(path), framework="pt") as fh:
        header = fh.metadata()
    assert json.loads(header["mmenc"]) == TOKEN_META
    assert header["mmenc_layout"] == "tokens"

    index_file = out.meta / "index" / "part-t00000-w00-000000.pq"
    assert index_file.exists()
    index = pq.read_table(index_file)
    assert index.column_names == [*INDEX_COLUMNS, "lab"]
    rows = index.to_pylist()
    assert [r["id"] for r in rows] == ["img", "txt", "img2"]
    assert [r["modality"] for r in rows] == ["image", "text", "image"]
    assert [r["shard"] for r in rows] == [SAFETENSORS] * 3
    assert [r["key"] for r in rows] == ["emb.0", "emb.1", "emb.2"]
    assert [r["tokens"] for r in rows] == [6, 3, 1]
    assert [r["dim"] for r in rows] == [DIM] * 3
    assert [r["dtype"] for r in rows] == [dtype] * 3
    assert [r["image_grid_thw"] for r in rows] == [[1, 2, 3], None, [1, 1, 1]]
    assert [(r["orig_width"], r["orig_height"]) for r in rows] == [(640, 480), (None, None), (8, 9)]
    assert [r["min_pixels"] for r in rows] == [100, None, None]
    assert [r["max_pixels"] for r in rows] == [9000, None, None]
    assert [r["lab"] for r in rows] == ["a", "5", None]
    assert index.schema.field("image_grid_thw").type == pa.list_(pa.int32(), 3)
    assert index.schema.field("orig_width").type == pa.int32()


@pytest.mark.parametrize("bad", [np.zeros((2, DIM + 1), np.float32), np.zeros(DIM, np.float32)])
def test_token_shard_of_wrong_shape_writes_nothing(out: OutDir, bad: np.ndarray) -> None:
    data = token_data()
    data.add("bad", "image", bad, {})
    writer = make_writer("parquet", TOKEN_META, "float16", ("lab",))
    with pytest.raises(ValueError, match=r"expected \[tokens, 4\]"):
        commit(out, writer, data, SAFETENSORS)
    assert top_files(out) == []
    assert list((out.meta / "index").iterdir()) == []
    assert tmp_files(out) == []


# -- the output's one atomic write (LocalFS) ---------------------------------------------------------

def test_a_staged_shard_is_fsynced_under_tmp_and_visible_only_when_published(out: OutDir) -> None:
    seen: list[Path] = []

    def write(p: Path) -> None:
        seen.append(p)
        p.write_bytes(b"payload")

    name = "part-t00000-w00-000007.parquet"
    tmp = out.fs.stage(out.tmp_path(name), write)
    assert seen == [tmp] and tmp.parent == out.meta / "tmp" and tmp.read_bytes() == b"payload"
    assert top_files(out) == []
    final = out.publish_shard(name, b"payload")
    assert final.read_bytes() == b"payload" and tmp_files(out) == []


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failed_write_leaves_no_temp_file(out: OutDir, exc: BaseException) -> None:
    def write(p: Path) -> None:
        p.write_bytes(b"partial")
        raise exc

    with pytest.raises(type(exc)):
        out.publish_shard("part-t00000-w00-000001.parquet", write)
    assert tmp_files(out) == [] and top_files(out) == []


def test_a_writer_that_writes_nothing_is_an_error(out: OutDir) -> None:
    """A writer that creates nothing cannot be fsynced: an error, not a silent empty shard."""
    with pytest.raises(FileNotFoundError):
        out.publish_shard("part-t00000-w00-000001.parquet", lambda p: None)
    assert tmp_files(out) == []


def test_a_failed_rewrite_leaves_the_previous_file_whole(out: OutDir) -> None:
    final = out.meta / "sidecars" / "part-t00000-w00-000003.pq"
    assert out.fs.publish(final, lambda p: p.write_text("new")) == final and final.read_text() == "new"

    def failing(p: Path) -> None:
        p.write_text("half")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        out.fs.publish(final, failing)
    assert final.read_text() == "new" and [p.name for p in final.parent.iterdir()] == [final.name]


def test_publish_creates_its_folder(out: OutDir) -> None:
    final = out.meta / "newfolder" / "f.parquet"
    out.fs.publish(final, b"x")
    assert final.read_bytes() == b"x"


def test_temp_side_files_of_a_killed_write_are_removed_when_the_task_restarts(out: OutDir) -> None:
    """A run killed while writing a sidecar or index leaves its temp file; `clean_tmp` of that
    task removes it (and the shard's own temp file), never another task's."""
    tmp = out.meta / "tmp"
    mine = [tmp / ".sidecars-part-t00000-w00-000001.parquet.tmp", tmp / ".index-part-t00000-w00-000002.parquet.tmp",
            tmp / ".part-t00000-w00-000003.parquet.tmp"]
    other = tmp / ".sidecars-part-t00001-w00-000001.parquet.tmp"
    for path in (*mine, other):
        path.write_bytes(b"partial")
    assert out.clean_tmp(0) == 3
    assert not any(p.exists() for p in mine) and other.exists()
