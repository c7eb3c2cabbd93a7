"""`mmenc ray`'s command line, where no cluster is needed: what it refuses before it connects (exit 2),
Ray itself missing (exit 3, naming the extra), and its help, which never imports Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    (["--connect-timeout", "0"], ["--connect-timeout"]),
    (["--batch-size", "4"], ["No such option", "encode options go after --"]),
], ids=["overwrite", "task-index", "out", "secret", "typo", "bad-rate", "tasks", "cpus", "gpus", "retries",
        "connect-timeout", "encode-option-before---"])
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
    for words in ("--address", "--gpus-per-task", "--cpus-per-task", "--max-retries", "--connect-timeout", "137"):
        assert words in res.output, words


class FakeDriver:
    """Stands in for the Ray driver: keeps the job's spec, hands back the job it is given."""

    def __init__(self, code: int = 0) -> None:
        self.spec: Any = None
        self.code = code

    def __call__(self, spec: Any, display: Any, stop: Any, signum: Any) -> Any:
        from mmenc_cli.engines.job import JobResult, TaskOutcome, merge_results

        self.spec = spec
        state = "done" if self.code == 0 else "lost"
        tasks = [TaskOutcome(task=t, code=self.code if t == 1 else 0, state=state if t == 1 else "done")
                 for t in range(spec.tasks)]
        return JobResult(tasks=tasks, result=merge_results(spec, tasks, 1.0), code=self.code,
                         reason=None if self.code == 0 else "task 1 lost: its worker died")


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr("mmenc_cli.cli.ray._driver", lambda: fake)
    return fake


@pytest.mark.parametrize("args,gpus", [
    ([], 0.0),
    (["--", "--device", "cuda"], 1.0),
    (["--", "--device", "cuda:0,cuda:1"], 2.0),
    (["--gpus-per-task", "0.5", "--", "--device", "cuda"], 0.5),
    (["--", "--device", "auto"], 0.0),
], ids=["cpu", "cuda", "two-devices", "given", "auto"])
def test_a_task_asks_for_a_gpu_where_the_encode_options_ask_for_cuda(manifest: Path, tmp_path: Path,
                                                                      driver: FakeDriver, args: list[str],
                                                                      gpus: float) -> None:
    res = ray(manifest, tmp_path / "out", *args)
    assert res.exit_code == 0, res.output
    assert driver.spec.gpus_per_task == gpus


def test_the_job_s_spec_from_the_command_line(manifest: Path, tmp_path: Path, driver: FakeDriver,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = ray(Path(manifest.name), Path("out"), "--cpus-per-task", "4", "--max-retries", "5", "--address",
              "10.0.0.1:6379", "--connect-timeout", "2.5", "--", "--max-errors", "7", "--batch-size", "16")
    assert res.exit_code == 0, res.output
    spec = driver.spec
    assert spec.cfg.manifests == (str(manifest),) and spec.cfg.writer.out == str(tmp_path / "out")
    assert (spec.tasks, spec.cpus_per_task, spec.max_retries, spec.address) == (3, 4, 5, "10.0.0.1:6379")
    assert spec.connect_timeout == 2.5
    assert spec.cfg.batch.workers == 3 and spec.cfg.batch.batch_size == 16  # a task's decode workers: its CPUs less one
    assert spec.cfg.max_errors == 7 and spec.task_config(2).max_errors is None
    assert ray(manifest, tmp_path / "out", "--cpus-per-task", "4", "--", "--workers", "1").exit_code == 0
    assert driver.spec.cfg.batch.workers == 1
    assert driver.spec.connect_timeout == 30.0  # the default


def test_the_driver_exits_with_the_job_s_code_and_prints_its_json(manifest: Path, tmp_path: Path,
                                                                  driver: FakeDriver) -> None:
    driver.code = 137
    res = ray(manifest, tmp_path / "out", "--", "--json")
    assert res.exit_code == 137
    job = json.loads(res.stdout)
    assert job["exit_code"] == 137 and [t["state"] for t in job["tasks"]] == ["done", "lost", "done"]
    assert "exit 137: task 1 lost: its worker died" in res.stderr and "mmenc status: not read" in res.stderr
