"""`mmenc ray`'s command line, where no cluster is needed: what it refuses before it connects (exit 2),
Ray itself missing (exit 3, naming the extra), and its help, which never imports Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    path = tmp_path / "m.jsonl"
    path.write_text('{"id": "a", "text": "t"}\n')
    return path


def ray(manifest: Path, out: Path, *args: str) -> object:
    return runner.invoke(app, ["ray", str(manifest), "--out", str(out), "--tasks", "3", "--model",
                               str(ROOT / "mmenc_cli" / "demo_model"), *args], catch_exceptions=False)


@pytest.mark.parametrize("args,words", [
    (["--", "--overwrite"], ["--overwrite cannot follow --"]),
    (["--", "--task-index", "1"], ["--task-index cannot follow --"]),
    (["--", "--out", "elsewhere"], ["--out cannot follow --"]),
    (["--", "--storage-option", "secret=hunter2"], ["would send a secret with every task", "credentials"]),
    (["--", "--batch-sise", "4"], ["encode options after --", "--batch-sise"]),
    (["--", "--max-error-rate", "2"], ["--max-error-rate must be between 0 and 1"]),
    (["--tasks", "0"], ["--tasks"]),
    (["--cpus-per-task", "0"], ["--cpus-per-task"]),
    (["--gpus-per-task", "-1"], ["--gpus-per-task"]),
    (["--max-retries", "-1"], ["--max-retries"]),
    (["--batch-size", "4"], ["No such option", "encode options go after --"]),
], ids=["overwrite", "task-index", "out", "secret", "typo", "bad-rate", "tasks", "cpus", "gpus", "retries",
        "encode-option-before---"])
def test_what_cannot_run_is_refused_before_connecting(manifest: Path, tmp_path: Path, args: list[str],
                                                       words: list[str]) -> None:
    res = ray(manifest, tmp_path / "out", *args)
    assert res.exit_code == 2, res.output
    assert all(w in res.output for w in words), res.output
    assert "hunter2" not in res.output and not (tmp_path / "out").exists()


def test_without_ray_installed_it_names_the_extra(manifest: Path, tmp_path: Path) -> None:
    fake = tmp_path / "site" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray (a test stands in for it)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-m", "mmenc_cli", "ray", str(manifest), "--out", str(tmp_path / "out"),
                           "--tasks", "2", "--", "--modality", "text"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "pip install 'mmenc[ray]'" in done.stderr and "Traceback" not in done.stderr


def test_the_help_names_the_job_s_exit_codes() -> None:
    res = runner.invoke(app, ["ray", "--help"])
    assert res.exit_code == 0
    for words in ("--address", "--gpus-per-task", "--cpus-per-task", "--max-retries", "137"):
        assert words in res.output, words
