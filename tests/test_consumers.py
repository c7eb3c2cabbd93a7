"""What mmenc writes opens, with no conversion, in the tools that come next: embedding-reader,
FAISS, LanceDB and Hugging Face datasets (each used through its own API, installed by the test
extra only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mmenc_cli.output.embeddings import read_embeddings
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg

N = 60


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output of 60 text embeddings in 4 Parquet shards, with a kept field."""
    root = tmp_path_factory.mktemp("consumers")
    rows = [{"id": f"t{i:03d}", "text": f"text number {i}", "lang": "en" if i % 2 else "fr"} for i in range(N)]
    cfg = make_cfg([write_jsonl(root / "m.jsonl", rows)], root / "out", shard_size=16, keep=("lang",))
    res = run_encode(cfg, encoder_factory=factory(FakeEncoder(dim=16)))
    assert res.counters.encoded == N
    return root / "out"


def test_embedding_reader_reads_exactly_the_embeddings(out: Path) -> None:
    embedding_reader = pytest.importorskip("embedding_reader")
    reader = embedding_reader.EmbeddingReader(str(out), file_format="parquet", embedding_column="embedding",
                                              meta_columns=["id", "lang"])
    assert reader.count == N and reader.dimension == 16
    got_ids, got = [], []
    for emb, meta in reader(batch_size=25, start=0, end=reader.count):
        got.append(emb)
        got_ids += list(meta["id"])
    ids, matrix = read_embeddings(out, "text")
    order = np.argsort(got_ids)
    assert sorted(got_ids) == sorted(ids)
    np.testing.assert_array_equal(np.concatenate(got)[order], matrix[np.argsort(ids)])


def test_embedding_reader_is_not_misled_by_a_safetensors_output(tmp_path: Path) -> None:
    """Side files are `.pq`, not `.parquet`: nothing under OUT looks like an embedding shard."""
    rows = [{"id": f"t{i}", "text": f"text {i}"} for i in range(10)]
    cfg = make_cfg([write_jsonl(tmp_path / "m.jsonl", rows)], tmp_path / "out", format="safetensors")
    run_encode(cfg, encoder_factory=factory(FakeEncoder()))
    sides = list((tmp_path / "out").rglob("*.pq"))
    assert sides and not list((tmp_path / "out").rglob("*.parquet"))
    embedding_reader = pytest.importorskip("embedding_reader")
    with pytest.raises(ValueError, match="No embeddings found"):  # it reads Parquet outputs; nothing here to misread
        embedding_reader.EmbeddingReader(str(tmp_path / "out"), file_format="parquet", embedding_column="embedding")
    before = read_embeddings(tmp_path / "out", "text")
    for side in sides:  # an output written before side files were named .pq still reads the same
        side.rename(side.with_suffix(".parquet"))
    after = read_embeddings(tmp_path / "out", "text")
    assert before[0] == after[0] and len(after[0]) == 10
    np.testing.assert_array_equal(before[1], after[1])


def test_faiss_finds_each_item_first(out: Path) -> None:
    faiss = pytest.importorskip("faiss")
    ids, matrix = read_embeddings(out, "text")
    index = faiss.IndexFlatIP(matrix.shape[1])
    index.add(np.ascontiguousarray(matrix / np.linalg.norm(matrix, axis=1, keepdims=True)))
    picks = np.random.default_rng(0).choice(len(ids), 10, replace=False)
    query = matrix[picks] / np.linalg.norm(matrix[picks], axis=1, keepdims=True)
    _, found = index.search(np.ascontiguousarray(query), 3)
    assert list(found[:, 0]) == list(picks)


def test_lancedb_table_from_the_arrow_dataset(out: Path, tmp_path: Path) -> None:
    lancedb = pytest.importorskip("lancedb")
    import pyarrow.dataset as ds

    db = lancedb.connect(str(tmp_path / "lance"))
    table = db.create_table("emb", data=ds.dataset(str(out)).to_table())
    ids, matrix = read_embeddings(out, "text")
    for i in (0, 17, 59):
        hit = table.search(matrix[i], vector_column_name="embedding").limit(1).to_list()
        assert hit[0]["id"] == ids[i]


def test_datasets_loads_the_output_and_indexes_it(out: Path) -> None:
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("faiss")
    dset = datasets.load_dataset("parquet", data_files=sorted(str(p) for p in out.glob("*.parquet")), split="train")
    assert len(dset) == N and dset.features["embedding"].length == 16
    assert dset.features["embedding"].feature.dtype == "float32"
    dset.add_faiss_index(column="embedding")
    query = np.asarray(dset[5]["embedding"], dtype=np.float32)
    _, found = dset.get_nearest_examples("embedding", query, k=1)
    assert found["id"][0] == dset[5]["id"]
