"""What a hostile user did to outputs in a bucket (and on disk) that once lost items or said "done"
over an incomplete output: two task counts in one output, objects removed mid-run, a refused
re-run that rewrote the task's record, `status` after a kill and over a deleted shard."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.output.test_store import encode, mmenc, start_encode, texts, vectors, wait_for_shards
from tests.s3server import bucket, s3_server, store_env  # noqa: F401

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def popen_encode(manifest: Path, out: str, env: dict[str, str]) -> subprocess.Popen:
    """`encode` in the background with `env` added, its stderr piped."""
    args = [sys.executable, "-m", "mmenc_cli", "encode", str(manifest), "--out", out, "--modality", "text",
            "--shard-size", "40", "--progress", "none", "--workers", "0"]
    return subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def s3fs_here(endpoint: str) -> Any:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return s3fs.S3FileSystem(endpoint_url=endpoint, key=store_env(endpoint)["AWS_ACCESS_KEY_ID"],
                             secret=store_env(endpoint)["AWS_SECRET_ACCESS_KEY"], use_listings_cache=False)


def test_pods_of_two_task_counts_are_refused_and_change_nothing(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 300)
    out = f"s3://{bucket}/emb"
    first = encode(manifest, out, "--task-count", "3", "--task-index", "1", endpoint=s3_server)
    assert first.returncode == 0, first.stderr
    fs = s3fs_here(s3_server)
    before = sorted(fs.find(f"{bucket}/emb"))
    second = encode(manifest, out, "--task-count", "4", "--task-index", "2", endpoint=s3_server)
    assert second.returncode == 3
    assert "started with 3 tasks" in second.stderr and "task 2 of 4" in second.stderr
    assert "--overwrite" in second.stderr and "new --out" in second.stderr
    assert sorted(fs.find(f"{bucket}/emb")) == before  # no record, report or shard of the refused run


def test_pods_of_two_task_counts_started_at_once_one_is_refused(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 2000)
    out = f"s3://{bucket}/emb"
    procs = [popen_encode(manifest, out, {"JOB_COMPLETION_INDEX": str(index), "MMENC_TASK_COUNT": str(count),
                                          **store_env(s3_server)})
             for index, count in ((1, 3), (2, 4))]
    codes = sorted(p.wait(300) for p in procs)
    assert codes == [0, 3], [p.stderr.read() for p in procs if p.stderr]
    ids = list(vectors(out))  # every id once
    assert 0 < len(ids) < 2000


def test_a_local_output_refuses_another_task_count_too(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl", 50)
    out = tmp_path / "out"
    assert encode(manifest, out, "--task-count", "2", "--task-index", "0").returncode == 0
    records = sorted(p.name for p in (out / "_mmenc" / "tasks").iterdir())
    refused = encode(manifest, out, "--task-count", "5", "--task-index", "4")
    assert refused.returncode == 3 and "started with 2 tasks" in refused.stderr
    assert sorted(p.name for p in (out / "_mmenc" / "tasks").iterdir()) == records


def test_objects_removed_mid_run_are_not_exit_0_and_a_rerun_completes(tmp_path: Path, bucket: str,
                                                                      s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 3000)
    out = f"s3://{bucket}/emb"
    proc = start_encode(manifest, out, s3_server, stderr=subprocess.PIPE)
    wait_for_shards(bucket, 3)
    s3fs_here(s3_server).rm(f"{bucket}/emb", recursive=True)  # the whole output, run.json included
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err
    assert "gone" in err and "run the same command again" in err
    again = encode(manifest, out, endpoint=s3_server)  # run.json was written again at the close
    assert again.returncode == 0, again.stderr
    assert sorted(vectors(out)) == sorted(f"t{i}" for i in range(3000))


def test_a_shard_removed_mid_run_on_disk_is_exit_3(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl", 3000)
    out = tmp_path / "out"
    proc = popen_encode(manifest, str(out), {})
    first = out / "part-t00000-w00-000000.parquet"
    deadline = time.monotonic() + 120
    while not first.exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    first.unlink()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3 and "part-t00000-w00-000000.parquet" in err
    record = json.loads((out / "_mmenc" / "tasks" / "task-00000.json").read_text())
    assert record["state"] == "failed"
    assert encode(manifest, out).returncode == 0
    assert sorted(vectors(str(out))) == sorted(f"t{i}" for i in range(3000))


def test_a_refused_rerun_changes_no_record_in_a_bucket(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 100)
    out = f"s3://{bucket}/emb"
    assert encode(manifest, out, endpoint=s3_server).returncode == 0
    fs = s3fs_here(s3_server)
    record = f"{bucket}/emb/_mmenc/tasks/task-00000.json"
    before = fs.cat_file(record)
    refused = encode(manifest, out, "--out-dtype", "float16", endpoint=s3_server)
    assert refused.returncode == 3 and "other options" in refused.stderr
    assert fs.cat_file(record) == before
    status = mmenc("status", out, "--json", endpoint=s3_server)
    assert status.returncode == 0 and json.loads(status.stdout)["tasks"][0]["state"] == "done"


def test_status_right_after_a_kill_says_crashed(tmp_path: Path, bucket: str, s3_server: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # the table's note column unfolded
    manifest = texts(tmp_path / "m.jsonl", 3000)
    out = f"s3://{bucket}/emb"
    proc = start_encode(manifest, out, s3_server)
    wait_for_shards(bucket, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = mmenc("status", out, endpoint=s3_server)
    assert done.returncode == 4
    assert "crashed" in done.stdout and f"pid {proc.pid}" in done.stdout and "running on" not in done.stdout
    task = json.loads(mmenc("status", out, "--json", endpoint=s3_server).stdout)["tasks"][0]
    assert task["running"] is False and task["needs_rerun"]


@pytest.mark.parametrize("where", ["bucket", "folder"])
def test_status_names_a_deleted_shard_and_what_mends_it(tmp_path: Path, where: str, request: pytest.FixtureRequest,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    manifest = texts(tmp_path / "m.jsonl", 200)
    endpoint = request.getfixturevalue("s3_server") if where == "bucket" else None
    out = f"s3://{request.getfixturevalue('bucket')}/emb" if where == "bucket" else str(tmp_path / "out")
    assert encode(manifest, out, endpoint=endpoint).returncode == 0
    name = "part-t00000-w00-000003.parquet"
    if endpoint:
        s3fs_here(endpoint).rm_file(f"{out[5:]}/{name}")
    else:
        (Path(out) / name).unlink()
    done = mmenc("status", out, endpoint=endpoint)
    assert done.returncode == 4
    text = " ".join(done.stdout.split())
    assert f"problem: shard {out}/{name} was committed by task 0 and is missing" in text, done.stdout
    assert "task -1" not in text and "all tasks done" not in text
    assert "run the same mmenc encode command again" in text
    task = json.loads(mmenc("status", out, "--json", endpoint=endpoint).stdout)["tasks"][0]
    assert task["needs_rerun"] and "missing" in task["reason"]
    assert encode(manifest, out, endpoint=endpoint).returncode == 0  # the mend it names
    assert mmenc("status", out, endpoint=endpoint).returncode == 0
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
