"""The one-shot GPU benchmark's smoke mode: `bash benchmarks/gpu.sh --smoke OUTDIR` runs every
stage of the full benchmark at tiny sizes on the CPU, so the script cannot rot unnoticed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

IMAGE_STAGES = ["mmenc_b16_gpu", "mmenc_b16_fast", "mmenc_l14_fast", "mmenc_b16_exact", "mmenc_b16_default_batch"]
RATE_STAGES = {"limit_b16": "images_per_s", "limit_l14": "images_per_s", "texts_st": "texts_per_s",
               "texts_mmenc": "texts_per_s", "baseline_b16": "images_per_s", **{s: "images_per_s" for s in IMAGE_STAGES}}


def test_gpu_bench_smoke(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MMENC_BENCH_CACHE", None)  # everything under tmp_path
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh"), "--smoke", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "install: skipped" in proc.stdout and "goals (one H100" in proc.stdout

    doc = json.loads((out / "gpu_bench.json").read_text())
    stages = doc["stages"]
    assert doc["mode"] == "smoke" and doc["summary"]["failed"] == [] and doc["summary"]["skipped"] == []
    expected = ["facts", "jpegs", "models", "limit_b16", "limit_l14", "mmenc_b16_gpu", "mmenc_b16_fast",
                "mmenc_l14_fast", "text_model", "texts_st", "texts_mmenc", "baseline_b16", "mmenc_b16_exact",
                "mmenc_b16_default_batch"]
    assert list(stages) == expected  # the goals' stages first
    for name in expected:
        assert stages[name]["status"] == "ok", (name, stages[name])
    for name, key in RATE_STAGES.items():
        assert stages[name][key] > 0, (name, stages[name])

    jpegs, sizes = stages["jpegs"], doc["sizes"]
    assert jpegs["unique"] == sizes["unique"] < sizes["rows"] and stages["text_model"]["texts"] == sizes["texts"]
    for name in IMAGE_STAGES:
        assert stages[name]["encoded"] == sizes["rows"], (name, stages[name])
        assert stages[name]["steady_per_s"] > 0 and stages[name]["steady"]["items"] > 0, (name, stages[name])
    assert stages["mmenc_b16_default_batch"]["batch_size"] == 32  # the CPU's default: no probe there
    assert stages["texts_st"]["encoded"] == sizes["texts"] and stages["texts_mmenc"]["encoded"] == sizes["texts"]
    base = stages["baseline_b16"]
    assert base["waves_timed"] >= sizes["min_waves"] and base["dev_shm_needed_bytes"] > 0
    assert base["workers"] == max(1, min(stages["facts"]["cpus"] - 1, sizes["baseline_workers"]))  # usable CPUs less one
    agreed = {**base["agreement"], **stages["mmenc_b16_exact"]["agreement"], **stages["texts_mmenc"]["agreement"]}
    assert set(agreed) == {"mmenc_b16_gpu vs baseline_b16", "mmenc_b16_fast vs baseline_b16",
                           "mmenc_b16_exact vs baseline_b16", "mmenc_b16_gpu vs mmenc_b16_exact",
                           "mmenc_b16_fast vs mmenc_b16_exact", "texts_mmenc vs texts_st"}
    assert all(v["min"] >= 0.99 and v["ids"] > 0 for v in agreed.values()), agreed
    assert stages["facts"]["cpus"] >= 1 and stages["facts"]["versions"]["torch"]
    goals = doc["summary"]["goals"]
    assert len(goals) == 4 and all(g["verdict"].startswith("not measured") for g in goals)
    assert all(g["value"] is not None for g in goals)
