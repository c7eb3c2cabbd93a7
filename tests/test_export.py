"""`mmenc export vllm`: the exported `image_embeds` / `image_grid_thw` equal the tiny model's own
reference output and the index's grids; CLI end to end with real decode worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmenc_cli.export import export_filename, export_vllm
from mmenc_cli.errors import OutputError
from mmenc_cli.output import OutDir
from mmenc_cli.run.pipeline import run_encode
from tests import modelfactory_vl as mf
from tests.conftest import write_jsonl
from tests.s3server import bucket, s3_server  # noqa: F401
from tests.test_tokens import make_cfg as tagged_cfg


def make_cfg(manifest: Path, out: Path, model: Path, **kw: Any) -> Any:
    """test_tokens' config without its kept field (these rows hold no `tag`)."""
    return tagged_cfg(manifest, out, model, keep=(), **kw)

REPO = Path(__file__).parents[1]
SIZES = [(40, 30), (200, 120), (50, 100), (120, 120), (64, 48)]


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mf.make_tiny_qwen25vl(tmp_path_factory.mktemp("vl") / "qwen25vl")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Image.Image]]:
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(11)
    rows, imgs = [], {}
    ids = ["plain", "with/slash", "../dots", "ünï cödé", "Plain"]  # ids that are unsafe or differ by case
    for id, (w, h) in zip(ids, SIZES):
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        name = f"im{len(rows)}.png"
        img.save(root / name)
        imgs[id] = img
        rows.append({"id": id, "image": name})
    return write_jsonl(root / "m.jsonl", rows), imgs


def mmenc(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "mmenc_cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def read_export(dest: Path) -> dict[str, dict[str, Any]]:
    from safetensors.numpy import load_file

    rows = [json.loads(line) for line in (dest / "manifest.jsonl").read_text().splitlines()]
    return {r["id"]: {**r, **load_file(dest / r["file"])} for r in rows}


def test_cli_encode_then_export_vllm_equals_the_reference(qwen25vl: Path, corpus: Any, tmp_path: Path) -> None:
    manifest, imgs = corpus
    out, dest = tmp_path / "out", tmp_path / "vllm"
    res = mmenc("encode", str(manifest), "--model", str(qwen25vl), "--out", str(out), "--pooling", "tokens",
                "--format", "safetensors", "--device", "cpu", "--dtype", "float32", "--max-batch-tokens", "24",
                "--batch-size", "4", "--workers", "1", "--progress", "none")
    assert res.returncode == 0, res.stderr
    res = mmenc("export", "vllm", str(out), str(dest), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["items"] == len(imgs) and summary["dtype"] == "float16"

    import pyarrow.parquet as pq

    index = {r["id"]: r for p in (OutDir(out).meta / "index").iterdir() for r in pq.read_table(p).to_pylist()}
    exported = read_export(dest)
    assert set(exported) == set(imgs) and len({e["file"] for e in exported.values()}) == len(imgs)
    ref = mf.reference_image_features(qwen25vl, list(imgs.values()))
    for (id, img), (want, grid) in zip(imgs.items(), ref):
        e = exported[id]
        assert e["file"] == export_filename(id) and "/" not in e["file"] and not e["file"].startswith(".")
        assert e["image_embeds"].dtype == np.float16 and e["image_embeds"].shape == (want.shape[0], mf.HIDDEN)
        np.testing.assert_allclose(e["image_embeds"].astype(np.float32), want.numpy(), rtol=0, atol=1e-3)
        assert e["image_grid_thw"].dtype == np.int64 and e["image_grid_thw"].tolist() == [list(grid)]
        assert e["image_grid_thw"].tolist() == [index[id]["image_grid_thw"]] == [e["image_grid_thw"][0].tolist()]
        assert (e["orig_width"], e["orig_height"]) == img.size and e["tokens"] == index[id]["tokens"]
    # a second export into the same folder needs --overwrite, and then replaces it
    assert mmenc("export", "vllm", str(out), str(dest)).returncode == 3
    assert mmenc("export", "vllm", str(out), str(dest), "--overwrite").returncode == 0
    assert set(read_export(dest)) == set(imgs)


def test_bfloat16_export_keeps_its_dtype(qwen25vl: Path, corpus: Any, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    manifest, imgs = corpus
    out = tmp_path / "out"
    run_encode(make_cfg(manifest, out, qwen25vl, out_dtype="bfloat16"))
    result = export_vllm(out, tmp_path / "vllm")
    assert result.items == len(imgs) and result.dtype == "bfloat16"
    ref = dict(zip(imgs, mf.reference_image_features(qwen25vl, list(imgs.values()))))
    for line in (tmp_path / "vllm" / "manifest.jsonl").read_text().splitlines():
        row = json.loads(line)
        t = load_file(tmp_path / "vllm" / row["file"])
        assert t["image_embeds"].dtype == torch.bfloat16 and t["image_grid_thw"].dtype == torch.int64
        want, grid = ref[row["id"]]
        assert t["image_grid_thw"].tolist() == [list(grid)]
        np.testing.assert_allclose(t["image_embeds"].float().numpy(), want.numpy(), rtol=1e-2, atol=1e-3)


def test_export_refuses_pooled_outputs_and_foreign_folders(qwen25vl: Path, corpus: Any, tmp_path: Path) -> None:
    manifest, _ = corpus
    pooled = tmp_path / "pooled"
    run_encode(make_cfg(manifest, pooled, qwen25vl, pooling="mean", format="parquet"))
    with pytest.raises(OutputError, match="not a --pooling tokens output"):
        export_vllm(pooled, tmp_path / "x")
    tokens = tmp_path / "tokens"
    run_encode(make_cfg(manifest, tokens, qwen25vl))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="not empty"):
        export_vllm(tokens, busy)
    assert (busy / "notes.txt").read_text() == "mine"


def test_export_from_a_bucket_equals_the_local_export(qwen25vl: Path, corpus: Any, tmp_path: Path,
                                                      bucket: str) -> None:
    pytest.importorskip("s3fs")
    manifest, imgs = corpus
    local, remote = tmp_path / "out", f"s3://{bucket}/tokens"
    for out in (local, remote):  # a token output (safetensors shards, Parquet index) in each
        assert run_encode(make_cfg(manifest, out, qwen25vl)).state == "done"
    export_vllm(local, tmp_path / "from-local")
    result = export_vllm(remote, tmp_path / "from-bucket")
    assert result.items == len(imgs)
    mine, theirs = read_export(tmp_path / "from-bucket"), read_export(tmp_path / "from-local")
    assert set(mine) == set(theirs) == set(imgs)
    for id, e in mine.items():
        assert np.array_equal(e["image_embeds"], theirs[id]["image_embeds"])
        assert e["image_grid_thw"].tolist() == theirs[id]["image_grid_thw"].tolist()


def test_export_filenames_are_safe_and_distinct() -> None:
    ids = ["a", "A", "a/b", "a_b", "../../etc/passwd", ".hidden", "", "x" * 500, "ünï", "a b", "a:b"]
    names = [export_filename(i) for i in ids]
    assert len(set(n.lower() for n in names)) == len(ids)  # distinct even on case-insensitive filesystems
    for n in names:
        assert n.endswith(".safetensors") and "/" not in n and not n.startswith(".") and len(n) < 100
        assert all(c.isascii() and (c.isalnum() or c in "._-") for c in n)
