"""`pip install .` (a wheel, not editable) gives a working `mmenc` with the demo model inside the
package: encoding the bundled samples from another folder needs no `--model` and no network."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "tests")


@pytest.mark.slow
def test_the_wheel_installs_and_encodes_the_samples_offline_from_any_folder(tmp_path: Path) -> None:
    src, dist, venv, elsewhere = tmp_path / "src", tmp_path / "dist", tmp_path / "venv", tmp_path / "elsewhere"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True)
    wheel = next(dist.glob("mmenc-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the fresh venv gets the dependencies (torch, transformers, ...) from this environment's
    # site-packages through a .pth file, and mmenc itself only from the wheel
    target = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    (target / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MMENC_DEFAULT_MODEL", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    where = subprocess.run([str(py), "-c", "import mmenc_cli; print(mmenc_cli.__file__)"], cwd=elsewhere, env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(venv), where  # the installed copy, not the source tree
    res = subprocess.run([str(venv / "bin" / "mmenc"), "encode", str(ROOT / "samples" / "manifest.jsonl"),
                          "--out", "out", "--json", "--progress", "none"], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "bundled DEMO model" in res.stderr and str(venv) in res.stderr
    doc = json.loads(res.stdout)
    assert doc["counters"]["encoded"] == 28 and doc["counters"]["balanced"] and doc["exit_code"] == 0
    assert list((elsewhere / "out").glob("part-*.parquet"))
