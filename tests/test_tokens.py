"""`--pooling tokens` through the pipeline with a tiny Qwen2-VL: token shards, index, token budget,
the token/grid/output-count checks (faults injected into the tower), pooled mode, resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from PIL import Image

from mmenc_cli.config import BatchConfig, ManifestConfig, MediaConfig, ModelConfig, RunConfig, WriterConfig
from mmenc_cli.encoders import load_encoder
from mmenc_cli.errors import MMError
from mmenc_cli.errors import OutputError
from mmenc_cli.output import OutDir
from mmenc_cli.run.pipeline import run_encode
from mmenc_cli.output.embeddings import iter_token_embeddings, read_embeddings, read_token_embedding
from mmenc_cli.output.inspect import inspect_output
from tests import modelfactory_vl as mf
from tests.conftest import write_jsonl

#: images of several sizes: 4 to 16 merged tokens each; 200x120 -> grid (1, 6, 10), 15 tokens, is
#: the GUILTY size of the fault-injection tests (its grid is unique here)
SIZES = [(40, 30), (90, 60), (50, 100), (200, 120), (120, 120), (64, 48), (50, 100), (90, 60)]
GUILTY_GRID = [1, 6, 10]


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mf.make_tiny_qwen2vl(tmp_path_factory.mktemp("vl") / "qwen2vl", with_tokenizer=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Image.Image]]:
    """A manifest of images of several sizes (+ one text-only row and one missing file)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(3)
    rows: list[dict[str, Any]] = []
    imgs = {}
    for i, (w, h) in enumerate(SIZES):
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        img.save(root / f"im{i}.png")
        imgs[f"r{i}"] = img
        rows.append({"id": f"r{i}", "image": f"im{i}.png", "text": f"caption {i}", "tag": i})
    rows += [{"id": "text-only", "text": "no image"}, {"id": "missing", "image": "nope.png"}]
    return write_jsonl(root / "m.jsonl", rows), imgs


def make_cfg(manifest: Path, out: Path, model: Path, **kw: Any) -> RunConfig:
    batch = BatchConfig(batch_size=kw.pop("batch_size", 4), workers=kw.pop("workers", 0),
                        max_batch_tokens=kw.pop("max_batch_tokens", None))
    writer = WriterConfig(out=str(out), format=kw.pop("format", "safetensors"), shard_size=kw.pop("shard_size", 3),
                          out_dtype=kw.pop("out_dtype", None))
    mcfg = ModelConfig(model=str(model), pooling=kw.pop("pooling", "tokens"), device="cpu", dtype="float32")
    return RunConfig(manifests=(str(manifest),), model=mcfg, writer=writer, batch=batch,
                     media=MediaConfig(fetch_timeout=0.5, fetch_retries=0),
                     manifest=ManifestConfig(keep=tuple(kw.pop("keep", ("tag",)))), **kw)


def error_rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in OutDir(out).error_report_paths() for line in p.read_text().splitlines()]


def tokens_of(out: Path) -> dict[str, tuple[np.ndarray, tuple[int, int, int]]]:
    return {e.id: (np.asarray(e.array, dtype=np.float32), e.grid) for e in iter_token_embeddings(out)}


class Recording:
    """Wraps an encoder: records each encode call's token sum; optional tower/_prepare faults."""

    def __init__(self, enc: Any) -> None:
        self.enc = enc
        self.calls: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.enc, name)

    def encode(self, modality: str, payloads: Any) -> Any:
        self.calls.append([p.meta["tokens"] for p in payloads])
        return self.enc.encode(modality, payloads)


def factory(enc: Any) -> Callable[..., Any]:
    return lambda cfg, device=None: enc


def loaded(model: Path, pooling: str = "tokens") -> Any:
    return load_encoder(ModelConfig(model=str(model), pooling=pooling, device="cpu", dtype="float32"))


def guilty(grid: Any) -> list[bool]:
    return [row == GUILTY_GRID for row in grid.tolist()]


@pytest.fixture(scope="module")
def clean(qwen2vl: Path, corpus: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A clean float32 run: the values the fault-injection runs must reproduce for innocent items."""
    out = tmp_path_factory.mktemp("clean") / "out"
    run_encode(make_cfg(corpus[0], out, qwen2vl, out_dtype="float32"))
    return tokens_of(out)


def test_tokens_budget_index_and_reference(qwen2vl: Path, corpus: Any, tmp_path: Path) -> None:
    manifest, imgs = corpus
    out = tmp_path / "out"
    rec = Recording(loaded(qwen2vl))
    result = run_encode(make_cfg(manifest, out, qwen2vl, max_batch_tokens=20, batch_size=3), encoder_factory=factory(rec))
    assert result.counters.balanced and result.counters.mod("image").encoded == len(SIZES)
    # batches respect the token budget (and the batch size), and every image went through once
    assert all(sum(c) <= 20 and len(c) <= 3 for c in rec.calls if len(c) > 1)
    assert sum(len(c) for c in rec.calls) == len(SIZES) and len(rec.calls) >= 3
    assert any(len(c) > 1 for c in rec.calls)
    assert [(e["id"], e["code"]) for e in error_rows(out)] == [("missing", 404)]
    # layout: data files at the top, the index under _mmenc/index, float16 by default
    od = OutDir(out)
    assert [p.suffix for p in od.shards()] == [".safetensors"] * 3
    assert sorted(p.name for p in (od.meta / "index").iterdir()) == [p.stem + ".pq" for p in od.shards()]
    import pyarrow.parquet as pq

    index = pq.read_table(od.meta / "index" / (od.shards()[0].stem + ".pq"))
    assert index.column_names == ["id", "modality", "shard", "key", "tokens", "dim", "dtype", "image_grid_thw",
                                  "orig_width", "orig_height", "min_pixels", "max_pixels", "frame_seconds", "tag"]
    grid_type = index.schema.field("image_grid_thw").type
    assert (grid_type.list_size, str(grid_type.value_type)) == (3, "int32")
    rows = {r["id"]: r for p in (od.meta / "index").iterdir() for r in pq.read_table(p).to_pylist()}
    # the vectors equal the model's own reference to 1e-3 in fp16; grids and sizes equal the index
    ref = mf.reference_image_features(qwen2vl, list(imgs.values()))
    for (id, img), (want, grid) in zip(imgs.items(), ref):
        arr, got_grid = read_token_embedding(out, id)
        assert arr.dtype == np.float16 and arr.shape == (want.shape[0], mf.HIDDEN)
        np.testing.assert_allclose(arr.astype(np.float32), want.numpy(), rtol=0, atol=1e-3)
        assert got_grid == grid and tuple(rows[id]["image_grid_thw"]) == grid
        r = rows[id]
        assert (r["tokens"], r["dim"], r["dtype"]) == (want.shape[0], mf.HIDDEN, "float16")
        assert (r["orig_width"], r["orig_height"]) == img.size
        assert (r["min_pixels"], r["max_pixels"], r["tag"]) == (mf.MIN_PIXELS, mf.MAX_PIXELS, id[1:])
    with pytest.raises(KeyError):
        read_token_embedding(out, "text-only")
    # inspect understands token shards; read_embeddings says what to use instead
    report = inspect_output(out)
    assert not report.problems and report.embeddings == len(SIZES) and report.dim == mf.HIDDEN
    with pytest.raises(ValueError, match="read_token_embedding"):
        read_embeddings(out)
    # resume: everything is done, the model is not even loaded
    again = run_encode(make_cfg(manifest, out, qwen2vl, max_batch_tokens=20, batch_size=3))
    assert not again.model_loaded and again.counters.mod("image").encoded_before == len(SIZES)


def test_float32_output_is_tight_and_bfloat16_reads_with_and_without_torch(qwen2vl: Path, corpus: Any, clean: Any,
                                                           tmp_path: Path) -> None:
    manifest, imgs = corpus
    ref = mf.reference_image_features(qwen2vl, list(imgs.values()))
    for (id, _), (want, grid) in zip(imgs.items(), ref):
        np.testing.assert_allclose(clean[id][0], want.numpy(), rtol=0, atol=1e-5)
        assert clean[id][1] == grid
    out = tmp_path / "bf16"
    run_encode(make_cfg(manifest, out, qwen2vl, out_dtype="bfloat16"))
    import torch

    for id, (want, _grid) in zip(imgs, ref):
        arr, _ = read_token_embedding(out, id, framework="pt")
        assert arr.dtype == torch.bfloat16
        np.testing.assert_allclose(arr.float().numpy(), want.numpy(), rtol=1e-2, atol=1e-3)
        # without torch: the same bits, widened exactly to float32
        widened, _ = read_token_embedding(out, id)
        assert widened.dtype == np.float32
        np.testing.assert_array_equal(widened, arr.float().numpy())
    assert not inspect_output(out).problems


@pytest.mark.parametrize("fault", ["rows", "total", "outputs", "grids"])
def test_injected_mismatch_fails_only_the_guilty_item(fault: str, qwen2vl: Path, corpus: Any, clean: Any,
                                                      tmp_path: Path) -> None:
    """rows: the tower returns one row too few for the guilty image (per-image outputs);
    total: the same, as one concatenated tensor (the real tower's shape); outputs: the guilty
    image's output is missing; grids: preprocessing's grids lose the guilty image's row."""
    import torch

    enc = loaded(qwen2vl)
    tower, prepare = enc.tower, enc._prepare

    def faulty_tower(pixel_values: Any, grid: Any) -> Any:
        merged = tower(pixel_values, grid)
        parts = list(torch.split(merged, (grid.prod(-1) // 4).tolist()))
        marks = guilty(grid)
        if fault == "rows":
            return [p[:-1] if g else p for p, g in zip(parts, marks)]
        if fault == "total":
            return torch.cat([p[:-1] if g else p for p, g in zip(parts, marks)])
        return [p for p, g in zip(parts, marks) if not g]

    def faulty_prepare(payloads: Any) -> Any:
        pixel_values, grid = prepare(payloads)
        keep = [not g for g in guilty(grid)]
        return pixel_values, grid[torch.tensor(keep, dtype=torch.bool)]

    if fault == "grids":
        enc._prepare = faulty_prepare
    else:
        enc.tower = faulty_tower
    out = tmp_path / "out"
    rec = Recording(enc)
    result = run_encode(make_cfg(corpus[0], out, qwen2vl, out_dtype="float32", batch_size=8),
                        encoder_factory=factory(rec))
    assert result.counters.balanced
    first = [clean[f"r{i}"][0].shape[0] for i in range(len(SIZES))]
    if fault != "rows":  # the batch failed as a whole: bisected down to the guilty image alone
        assert rec.calls[0] == first and [15] in rec.calls and len(rec.calls) > 3
    else:  # per-image outputs: the check pins the guilty image without re-encoding anything
        assert rec.calls == [first]
    errs = [(e["id"], e["code"], e["reason"], e["message"]) for e in error_rows(out) if e["id"] != "missing"]
    expected = {
        "rows": ("encode.token_mismatch", "Encoder produced 14 tokens, but preprocessing expected 15"),
        "total": ("encode.token_mismatch", "Encoder produced 14 tokens, but preprocessing expected 15"),
        "outputs": ("encode.output_count", "the vision tower returned 0 outputs for 1 image"),
        "grids": ("preprocess.failed", "preprocessing produced 0 image grids for 1 image"),
    }[fault]
    assert errs == [("r3", 500, *expected)]
    got = tokens_of(out)
    assert set(got) == set(clean) - {"r3"}
    for id, (arr, grid) in got.items():  # no shift: every innocent item has exactly its clean value
        assert np.array_equal(arr, clean[id][0]) and grid == clean[id][1]


def test_mean_pooling_is_written_like_any_pooled_embedding(qwen2vl: Path, corpus: Any, clean: Any,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "mean"
    result = run_encode(make_cfg(corpus[0], out, qwen2vl, pooling="mean", format="parquet"))
    assert result.facts["output_kind"] == "pooled" and result.facts["out_dtype"] == "float32"
    ids, matrix = read_embeddings(out)
    assert matrix.shape == (len(SIZES), mf.HIDDEN)
    for id, vec in zip(ids, matrix):
        np.testing.assert_allclose(vec, clean[id][0].mean(axis=0), rtol=0, atol=1e-6)


def test_mean_pooling_checks_tokens_before_pooling(qwen2vl: Path, corpus: Any, clean: Any, tmp_path: Path) -> None:
    """A wrong token count cannot hide in a mean: the batch is bisected, the guilty image fails."""
    import torch

    enc = loaded(qwen2vl, pooling="mean")
    tower = enc.tower
    enc.tower = lambda pv, grid: [p[:-1] if g else p for p, g in
                                  zip(torch.split(tower(pv, grid), (grid.prod(-1) // 4).tolist()), guilty(grid))]
    out = tmp_path / "out"
    run_encode(make_cfg(corpus[0], out, qwen2vl, pooling="mean", format="parquet", batch_size=8),
               encoder_factory=factory(enc))
    errs = [(e["id"], e["code"], e["reason"], e["message"]) for e in error_rows(out) if e["id"] != "missing"]
    assert errs == [("r3", 500, "encode.token_mismatch", "Encoder produced 14 tokens, but preprocessing expected 15")]
    ids, matrix = read_embeddings(out)
    assert sorted(ids) == sorted(set(clean) - {"r3"})
    for id, vec in zip(ids, matrix):
        np.testing.assert_allclose(vec, clean[id][0].mean(axis=0), rtol=0, atol=1e-6)


def test_text_request_is_a_startup_error(qwen2vl: Path, corpus: Any, tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="cannot encode text"):
        run_encode(make_cfg(corpus[0], tmp_path / "out", qwen2vl, modalities=("text",)))


def test_index_of_an_unrenamed_shard_is_cleaned(qwen2vl: Path, corpus: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_encode(make_cfg(corpus[0], out, qwen2vl))
    od = OutDir(out)
    orphan = od.meta / "index" / "part-t00000-w00-000099.pq"
    orphan.write_bytes(b"half written")
    kept = sorted((od.meta / "index").iterdir())
    assert od.clean_tmp(0) == 1
    assert not orphan.exists() and sorted((od.meta / "index").iterdir()) == [p for p in kept if p != orphan]


def test_check_outputs_reports_rows_per_item(qwen2vl: Path) -> None:
    enc = loaded(qwen2vl)
    prep = enc.image_preprocessor()
    payloads = [prep(Image.new("RGB", (90, 60))), prep(Image.new("RGB", (200, 120)))]
    vectors = [np.zeros((6, mf.HIDDEN), np.float32), np.zeros((16, mf.HIDDEN), np.float32)]
    errs = enc.check_outputs("image", payloads, vectors)
    assert errs[0] is None and isinstance(errs[1], MMError)
    assert (errs[1].code, errs[1].reason, errs[1].message) == (
        500, "encode.token_mismatch", "Encoder produced 16 tokens, but preprocessing expected 15")
