"""The one-shot GPU benchmark's smoke mode: `bash benchmarks/gpu.sh --smoke OUTDIR` runs every
stage of the full benchmark at tiny sizes on the CPU, so the script cannot rot unnoticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

IMAGE_STAGES = ["mmenc_b16_fast", "mmenc_b16_gpu", "baseline_b16", "mmenc_l14_fast", "mmenc_b16_exact",
                "mmenc_b16_default_batch"]
RATE_STAGES = {"limit_b16": "images_per_s", "limit_l14": "images_per_s", "texts_st": "texts_per_s",
               "texts_mmenc": "texts_per_s", **{s: "images_per_s" for s in IMAGE_STAGES}}


def test_gpu_bench_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MMENC_BENCH_CACHE", None)  # everything under tmp_path
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), "--smoke", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "install: skipped" in proc.stdout and "goals, informational" in proc.stdout

    doc = json.loads((out / "gpu_bench.json").read_text())
    stages = doc["stages"]
    assert doc["mode"] == "smoke" and doc["summary"]["failed"] == [] and doc["summary"]["skipped"] == []
    expected = ["facts", "jpegs", "models", "limit_b16", "limit_l14", "mmenc_b16_fast", "mmenc_b16_gpu",
                "baseline_b16", "mmenc_l14_fast", "text_model", "texts_st", "texts_mmenc", "mmenc_b16_exact",
                "mmenc_b16_default_batch"]
    assert list(stages) == expected
    for name in expected:
        assert stages[name]["status"] == "ok", (name, stages[name])
    for name, key in RATE_STAGES.items():
        assert stages[name][key] > 0, (name, stages[name])

    images, texts = doc["sizes"]["images"], doc["sizes"]["texts"]
    assert stages["jpegs"]["count"] == images and stages["text_model"]["texts"] == texts
    for name in IMAGE_STAGES:
        assert stages[name]["encoded"] == images, (name, stages[name])
    assert stages["texts_st"]["encoded"] == texts and stages["texts_mmenc"]["encoded"] == texts
    assert stages["facts"]["cpus"] >= 1 and stages["facts"]["versions"]["torch"]
    assert all(v is not None for v in doc["summary"]["numbers"].values())
