"""`mmenc ray` on a real Ray cluster (tests/ray_cluster.py): a 3-task job into the local S3 server
whose running `ray::mmenc_task` worker is SIGKILLed mid-run equals a clean local run, the killed
task resumed by Ray's retry exactly once; error thresholds apply to the job across tasks and every
failed item is reported once; a stopped driver cancels its tasks and the same command resumes; a
task whose slice a live runner holds waits for it; a model or an input that does not resolve on
the workers is a clear error before any task runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from mmenc_cli.output import OutDir, parse_shard_name, read_json
from mmenc_cli.output.embeddings import read_embeddings
from mmenc_cli.output.locks import TaskLock
from tests.ray_cluster import ray_address, ray_env, require_ray
from tests.s3server import bucket, s3_server, store_env  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "mmenc_cli" / "demo_model"
ENCODE = ["--modality", "text", "--shard-size", "40", "--progress", "none"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _ray() -> None:
    require_ray()


def texts(path: Path, n: int, empty: tuple[int, ...] = ()) -> Path:
    """`n` text rows; the rows at `empty` have an empty text (a 422 error row each)."""
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"t{i}", "text": "" if i in empty else f"text number {i}"}) + "\n")
    return path


def mmenc(*args: Any, endpoint: str | None = None, background: bool = False, **kw: Any) -> Any:
    """`python -m mmenc_cli ARGS` from this checkout, with the test cluster's variables (and the
    store's credentials for the driver's own process, where a store is used)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **ray_env(), **(store_env(endpoint) if endpoint else {})}
    cmd = [sys.executable, "-m", "mmenc_cli", *map(str, args)]
    if background:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, **kw)


def ray_job(manifest: Path, out: str, *extra: str, address: str | None = None, **kw: Any) -> Any:
    """`mmenc ray` of `manifest` into `out` in 3 tasks; `extra`: encode options."""
    return mmenc("ray", manifest, "--out", out, "--tasks", "3", "--address", address or ray_address(), "--model",
                 DEMO, "--", *ENCODE, "--json", *extra, **kw)


def local_run(manifest: Path, out: Path) -> None:
    done = mmenc("encode", manifest, "--out", out, "--model", DEMO, "--workers", "0", *ENCODE)
    assert done.returncode == 0, done.stderr


def vectors(out: str) -> dict[str, np.ndarray]:
    ids, matrix = read_embeddings(out, "text")
    assert len(ids) == len(set(ids)), "an id committed twice"
    return dict(zip(ids, matrix))


def assert_same(out: str, clean: Path) -> None:
    got, want = vectors(out), vectors(str(clean))
    assert got.keys() == want.keys()
    for key in want:  # batches of other texts pad differently: equal up to float noise
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0, err_msg=key)


def errors_of(out: str, endpoint: str | None = None) -> dict[str, Any]:
    done = mmenc("errors", "summary", out, "--json", endpoint=endpoint)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    return {k: summary[k] for k in ("errors", "by_code", "by_reason")}


def task_worker(od: OutDir, min_shards: int) -> tuple[int, int] | None:
    """(task, pid) of a task running in a live `ray::mmenc_task` worker on this host that has
    committed at least `min_shards` shards, if any."""
    shards: dict[int, int] = {}
    for shard in od.shards():
        parsed = parse_shard_name(shard.name)
        if parsed is not None:
            shards[parsed.task] = shards.get(parsed.task, 0) + 1
    for _, path in od.task_meta_paths():
        meta = read_json(path)
        if not isinstance(meta, dict) or meta.get("state") != "running" or shards.get(meta["task"], 0) < min_shards:
            continue
        try:
            if psutil.Process(int(meta["pid"])).cmdline()[0].startswith("ray::mmenc_task"):
                return int(meta["task"]), int(meta["pid"])
        except (psutil.Error, IndexError):
            continue
    return None


def kill_a_running_task(od: OutDir, driver: subprocess.Popen) -> int:
    """SIGKILL the worker of a task mid-run (after its second shard); the task's number."""
    deadline = time.monotonic() + 180
    while (found := task_worker(od, 2)) is None:
        assert driver.poll() is None, f"the job ended before a task could be killed:\n{driver.stderr.read()}"
        assert time.monotonic() < deadline, "no task committed two shards in time"
        time.sleep(0.1)
    task, pid = found
    os.kill(pid, signal.SIGKILL)
    return task


def test_a_killed_task_worker_is_retried_and_the_job_equals_a_clean_run(tmp_path: Path, bucket: str,
                                                                        s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 4500, empty=tuple(range(299, 4500, 300)))
    out = f"s3://{bucket}/emb"
    driver = ray_job(manifest, out, endpoint=s3_server, background=True)
    killed = kill_a_running_task(OutDir(out), driver)
    stdout, stderr = driver.communicate(timeout=600)
    assert driver.returncode == 0, stderr
    job = json.loads(stdout)
    attempts = {t["task"]: t["attempts"] for t in job["tasks"]}
    assert attempts[killed] == 2 and sum(attempts.values()) == 4, (attempts, stderr)
    assert [t["state"] for t in job["tasks"]] == ["done"] * 3 and job["status"]["all_done"]
    assert job["counters"]["balanced"] and job["counters"]["encoded"] == 4485
    local_run(manifest, tmp_path / "clean")
    assert_same(out, tmp_path / "clean")
    assert errors_of(out, s3_server) == errors_of(str(tmp_path / "clean"))  # each failed item once
    assert "retried" in stderr and f"task {killed} done after 1 retry" in stderr


def test_error_thresholds_apply_to_the_job_across_tasks(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl", 30, empty=(4, 15, 26))  # one failed item in each task's slice
    out = tmp_path / "out"
    over = ray_job(manifest, str(out), "--max-errors", "2", address="local")  # each task alone: 1 <= 2
    assert over.returncode == 4, over.stderr
    job = json.loads(over.stdout)
    assert job["threshold_exceeded"] == "3 errors > --max-errors 2" and job["counters"]["failed"] == 3
    assert [t["state"] for t in job["tasks"]] == ["done"] * 3
    assert [t["errors"] for t in job["status"]["tasks"]] == [1, 1, 1]
    assert "3 items failed" in over.stderr and "422 unusable input: 3" in over.stderr
    again = ray_job(manifest, str(out), "--max-errors", "3")  # resumes: each failed item counted once, earlier
    assert again.returncode == 0, again.stderr
    counted = json.loads(again.stdout)["counters"]["modalities"]["text"]
    assert counted["failed_before"] == 3 and counted["encoded_before"] == 27 and counted["encoded"] == 0
    assert errors_of(str(out))["errors"] == 3


def test_a_stopped_driver_cancels_its_tasks_and_the_same_command_resumes(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl", 4500)
    out = tmp_path / "out"
    driver = ray_job(manifest, str(out), background=True)
    od = OutDir(out)
    deadline = time.monotonic() + 180
    while task_worker(od, 2) is None:
        assert driver.poll() is None and time.monotonic() < deadline, "no task committed two shards in time"
        time.sleep(0.1)
    driver.send_signal(signal.SIGINT)
    stdout, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 130, stderr
    stopped = json.loads(stdout)
    assert stopped["counters"]["encoded"] < 4500 and {"cancelled", "interrupted"} & {t["state"] for t in stopped["tasks"]}
    assert "re-run" in stderr or "run the same command again" in stderr
    again = ray_job(manifest, str(out))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"]["all_done"]
    local_run(manifest, tmp_path / "clean")
    assert_same(str(out), tmp_path / "clean")


def test_a_task_whose_slice_a_live_runner_holds_waits_for_it_then_resumes(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl", 300)
    out = tmp_path / "out"
    od = OutDir(out)
    od.prepare()
    lock = TaskLock(od.lock_path(1))
    lock.acquire()  # another runner of task 1, alive (this process)
    try:
        driver = ray_job(manifest, str(out), background=True)
        deadline = time.monotonic() + 180
        while not all(state_of(od, t) == "done" for t in (0, 2)):
            assert driver.poll() is None and time.monotonic() < deadline, "tasks 0 and 2 did not finish"
            time.sleep(0.1)
        assert driver.poll() is None and not [s for s in od.shards() if s.name.startswith("part-t00001-")]
    finally:
        lock.release()
    stdout, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 0, stderr
    assert [t["state"] for t in json.loads(stdout)["tasks"]] == ["done"] * 3
    local_run(manifest, tmp_path / "clean")
    assert_same(str(out), tmp_path / "clean")


def state_of(od: OutDir, task: int) -> str | None:
    meta = read_json(od.task_meta_path(task)) if od.task_meta_path(task).exists() else None
    return meta.get("state") if isinstance(meta, dict) else None


@pytest.mark.parametrize("what", ["input", "model"])
def test_what_does_not_resolve_on_the_workers_stops_the_job_before_any_task(tmp_path: Path, what: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 10)
    out = tmp_path / "out"
    args = ["ray", manifest, "--out", out, "--tasks", "3", "--address", ray_address(), "--model", DEMO, "--", *ENCODE]
    if what == "input":
        args[1] = tmp_path / "not-there.jsonl"
    else:
        args[args.index("--model") + 1] = tmp_path / "no-model"
    done = mmenc(*args)
    assert done.returncode == (2 if what == "input" else 3), done.stderr
    assert "on the Ray worker on" in done.stderr and "Traceback" not in done.stderr
    assert ("not-there.jsonl does not exist" if what == "input" else "no-model") in done.stderr
    assert not out.exists()
