"""`mmenc status OUT`: per-task state, counts, errors, crashed tasks, duplicates across tasks, exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.output import OutDir, parse_shard_name, read_json, write_json_atomic
from mmenc_cli.run.pipeline import run_encode
from mmenc_cli.output.status import collect_status
from tests.conftest import make_image, write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg

REPO = Path(__file__).resolve().parent.parent
TASKS = 3


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 3-task output of 30 rows (images and texts; row 25's image is missing), and its manifest."""
    base = tmp_path_factory.mktemp("status")
    rows: list[dict[str, Any]] = []
    for i in range(30):
        row: dict[str, Any] = {"id": f"r{i:02d}", "text": f"caption number {i}"}
        if i % 2 == 0:
            row["image"] = make_image(base / f"i{i}.png", seed=i).name
        rows.append(row)
    rows[25]["image"] = "missing.png"
    manifest = write_jsonl(base / "m.jsonl", rows)
    out = base / "out"
    for t in range(TASKS):
        run_encode(make_cfg([manifest], out, task_index=t, task_count=TASKS, shard_size=4),
                   encoder_factory=factory(FakeEncoder()))
    return out, manifest


@pytest.fixture
def out(built: tuple[Path, Path], tmp_path: Path) -> Path:
    """A private copy of the built output (tests change it)."""
    return Path(shutil.copytree(built[0], tmp_path / "out"))


def status_json(out: Path) -> tuple[int, dict[str, Any]]:
    res = CliRunner().invoke(app, ["status", str(out), "--json"])
    return res.exit_code, json.loads(res.stdout)


def test_all_done(out: Path) -> None:
    code, s = status_json(out)
    assert code == 0
    assert s["all_done"] is True and s["rerun"] == [] and s["task_count"] == TASKS
    assert s["duplicates"] == {"count": 0, "within_task": 0, "examples": [], "ids": 0}
    assert [t["task"] for t in s["tasks"]] == [0, 1, 2]
    assert all(t["state"] == "done" and not t["needs_rerun"] and not t["running"] and t["host"] and t["updated"]
               for t in s["tasks"])
    per_task = {t: 0 for t in range(TASKS)}
    for shard in OutDir(out).shards():
        per_task[parse_shard_name(shard.name).task] += 1  # type: ignore[union-attr]
    assert all(per_task.values())  # every task wrote shards
    assert sum(t["encoded"] for t in s["tasks"]) == 30 + 16 - 1  # texts + images (15 + row 25) - the missing one
    assert [t["errors"] for t in s["tasks"]] == [0, 0, 1]  # row 25 is in the last third
    assert all(t["encoded"] > 0 for t in s["tasks"])


def test_task_without_metadata_needs_rerun(out: Path) -> None:
    OutDir(out).task_meta_path(1).unlink()
    code, s = status_json(out)
    assert code == 4
    assert s["all_done"] is False and s["rerun"] == [1]
    t1 = s["tasks"][1]
    assert t1["state"] == "missing" and t1["needs_rerun"] and "no task metadata" in t1["reason"]
    assert t1["encoded"] > 0  # its shards are still counted


def test_interrupted_and_threshold_need_rerun(out: Path, built: tuple[Path, Path]) -> None:
    od = OutDir(out)
    meta = read_json(od.task_meta_path(0))
    write_json_atomic(od.task_meta_path(0), {**meta, "state": "interrupted"})
    # task 2 again with --max-errors 0: its earlier failure counts, the threshold is exceeded
    result = run_encode(make_cfg([built[1]], out, task_index=2, task_count=TASKS, shard_size=4, max_errors=0),
                        encoder_factory=factory(FakeEncoder()))
    assert result.threshold_exceeded
    code, s = status_json(out)
    assert code == 4 and s["rerun"] == [0, 2]
    assert s["tasks"][0]["reason"] == "interrupted"
    assert s["tasks"][2]["state"] == "done" and "threshold" in s["tasks"][2]["reason"]


def test_running_without_lock_holder_is_crashed(out: Path) -> None:
    od = OutDir(out)
    meta = read_json(od.task_meta_path(2))
    write_json_atomic(od.task_meta_path(2), {**meta, "state": "running", "pid": 999999})
    code, s = status_json(out)
    assert code == 4 and s["rerun"] == [2]
    t2 = s["tasks"][2]
    assert t2["state"] == "running" and t2["running"] is False and t2["needs_rerun"]
    assert "crashed" in t2["reason"]
    # the probe took nothing for good: a run can still take the lock
    od.lock(2).release()


def test_running_with_live_lock_holder(out: Path) -> None:
    od = OutDir(out)
    meta = read_json(od.task_meta_path(1))
    write_json_atomic(od.task_meta_path(1), {**meta, "state": "running"})
    lock = od.lock(1)  # a separate open file: flock conflicts even within one process
    try:
        report = collect_status(out)
    finally:
        lock.release()
    t1 = report.tasks[1]
    assert t1.running and not t1.needs_rerun and "running on" in (t1.reason or "")
    assert report.rerun == [] and not report.all_done and not report.ok


def test_duplicates_across_tasks(out: Path) -> None:
    od = OutDir(out)
    first = next(s for s in od.shards() if s.name.startswith("part-t00000-"))
    copied = out / "part-t00002-w00-000099.parquet"
    shutil.copy(first, copied)
    import pyarrow.parquet as pq

    dup_keys = set(zip(*(pq.read_table(first, columns=["id", "modality"]).column(c).to_pylist()
                         for c in ("id", "modality"))))
    code, s = status_json(out)
    assert code == 4
    assert s["all_done"] is True  # every task is done; the duplicates alone fail the exit code
    assert s["duplicates"]["count"] == len(dup_keys) and s["duplicates"]["within_task"] == 0
    ex = s["duplicates"]["examples"]
    assert ex and all((e["id"], e["modality"]) in dup_keys and sorted(e["tasks"]) == [0, 2] for e in ex)
    # the same shard twice within one task is reported separately
    copied.rename(out / "part-t00000-w00-000099.parquet")
    _, s = status_json(out)
    assert s["duplicates"]["count"] == 0 and s["duplicates"]["within_task"] == len(dup_keys)


def test_human_output_and_rerun_hint(out: Path) -> None:
    script = OutDir(out).meta / "slurm" / "encode-1.sbatch"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/bash\n")
    OutDir(out).task_meta_path(2).unlink()
    res = CliRunner().invoke(app, ["status", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 4
    assert "done" in res.stdout and "missing" in res.stdout
    assert f"sbatch --array=2 {script}" in res.stdout


def test_not_an_output_exits_3(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "nope"):
        res = CliRunner().invoke(app, ["status", str(path)])
        assert res.exit_code == 3, res.output
        assert "mmenc: error:" in res.stderr


def test_status_and_slurm_do_not_import_torch(out: Path, built: tuple[Path, Path]) -> None:
    code = f"""
import json, sys
from mmenc_cli.cli import app
for args in (["status", {str(out)!r}, "--json"],
             ["slurm", {str(built[1])!r}, "--out", {str(out)!r}, "--model", "org/m", "--tasks", "3", "--script", "-"]):
    try:
        app(args, prog_name="mmenc")
    except SystemExit as exc:
        assert exc.code in (0, None), (args, exc.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps(heavy), file=sys.stderr)
"""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stderr.strip().splitlines()[-1]) == []
    assert json.loads(res.stdout[:res.stdout.index("#!/bin/bash")])["all_done"] is True
