"""Batch-job behaviour through the real CLI in subprocesses: SIGKILL at exact points then resume,
locking, SIGTERM/SIGINT, exit codes. Uses a tiny random CLIP built from a config."""

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
import pytest

from mmenc_cli.output import OutDir
from mmenc_cli.output.locks import TaskLock
from mmenc_cli.output.embeddings import read_embeddings
from tests.conftest import make_image, write_jsonl

ROOT = Path(__file__).resolve().parent.parent


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def mmenc(*args: Any, kill_at: str | None = None, check: bool = False, **kw: Any) -> subprocess.CompletedProcess:
    """Run the CLI (through tests/killer.py when a kill point is given)."""
    entry = [str(ROOT / "tests" / "killer.py")] if kill_at else ["-m", "mmenc_cli"]
    extra = {"KILL_AT": kill_at} if kill_at else {}
    proc = subprocess.run([sys.executable, *entry, *map(str, args)], capture_output=True, text=True,
                          env=env(**extra), timeout=300, **kw)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def job_manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("job")
    rows = []
    for i in range(40):
        row: dict[str, Any] = {"id": f"item-{i:03d}", "text": f"a photo of the cat number {i}"}
        if i % 2 == 0:
            row["image"] = make_image(d / f"{i}.png", (24 + i, 20 + 2 * i), seed=i).name
        rows.append(row)
    rows.insert(7, {"id": "broken", "image": "missing.png"})
    return write_jsonl(d / "manifest.jsonl", rows)


def shm_segments() -> set[str]:
    """Every shared-memory segment on the machine (not only mmenc's)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def encode_args(manifest: Path, out: Path, model: Path) -> list[Any]:
    return ["encode", manifest, "--out", out, "--model", model, "--device", "cpu", "--batch-size", "4",
            "--shard-size", "6", "--workers", "1", "--progress", "none"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory, job_manifest: Path, tiny_clip: Path) -> Path:
    out = tmp_path_factory.mktemp("clean") / "out"
    mmenc(*encode_args(job_manifest, out, tiny_clip), check=True)
    return out


def vectors(out: Path) -> dict[tuple[str, str], np.ndarray]:
    got: dict[tuple[str, str], np.ndarray] = {}
    for mod in ("image", "text"):
        ids, mat = read_embeddings(out, mod)
        assert len(ids) == len(set(ids)), f"duplicate {mod} ids in {out}"
        got.update({(i, mod): v for i, v in zip(ids, mat)})
    return got


def assert_same_output(out: Path, ref: Path) -> None:
    a, b = vectors(out), vectors(ref)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kill_at", ["mid_batch:3", "before_rename:2", "after_rename:2", "end"])
def test_sigkill_then_rerun_equals_clean_run(kill_at: str, tmp_path: Path, job_manifest: Path, tiny_clip: Path,
                                             clean_run: Path) -> None:
    out = tmp_path / "out"
    before = shm_segments()
    killed = mmenc(*encode_args(job_manifest, out, tiny_clip), kill_at=kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # the decode workers' shared memory goes with the killed process (its workers exit, then
    # Python's resource tracker unlinks the segment): /dev/shm itself, not mmenc's bookkeeping
    deadline = time.monotonic() + 20
    while shm_segments() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shm_segments() - before == set()  # nothing new is left (others' may have come and gone)
    od = OutDir(out)
    if kill_at.startswith("before_rename"):
        assert list((od.meta / "tmp").glob(".part-*")), "a temp shard should be left behind"
    assert json.loads(od.task_meta_path(0).read_text())["state"] == "running"
    again = mmenc(*encode_args(job_manifest, out, tiny_clip))
    assert again.returncode == 0, again.stderr
    assert not list((od.meta / "tmp").glob(".part-*")), "leftover temp shards must be cleaned"
    assert json.loads(od.task_meta_path(0).read_text())["state"] == "done"
    assert_same_output(out, clean_run)
    # the missing image failed in the first run (or the second): one current error either way
    from mmenc_cli.error_rows import latest_errors

    errs = latest_errors(out)
    assert [(e["id"], e["code"]) for e in errs] == [("broken", 404)]


def test_finished_rerun_is_fast_and_loads_no_model(tmp_path: Path, job_manifest: Path, tiny_clip: Path,
                                                   clean_run: Path) -> None:
    t0 = time.monotonic()
    proc = mmenc(*encode_args(job_manifest, clean_run, tiny_clip))
    assert proc.returncode == 0, proc.stderr
    assert "the model was not loaded" in proc.stderr
    assert time.monotonic() - t0 < 30
    meta = json.loads(OutDir(clean_run).task_meta_path(0).read_text())
    assert meta["model_loaded"] is False and meta["state"] == "done"


def test_conflicting_options_exit_3_with_one_line(tmp_path: Path, job_manifest: Path, tiny_clip: Path,
                                                  clean_run: Path) -> None:
    proc = mmenc(*encode_args(job_manifest, clean_run, tiny_clip), "--text-prefix", "query: ")
    assert proc.returncode == 3
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mmenc: error")]
    assert len(lines) == 1 and "text_prefix" in lines[0] and "Traceback" not in proc.stderr


def test_lock_busy_exits_75_then_wait_lock_waits(tmp_path: Path, job_manifest: Path, tiny_clip: Path) -> None:
    out = tmp_path / "out"
    od = OutDir(out)
    od.prepare()
    lock = TaskLock(od.lock_path(0))
    lock.acquire()
    t0 = time.monotonic()
    proc = mmenc(*encode_args(job_manifest, out, tiny_clip))
    assert proc.returncode == 75 and "--wait-lock" in proc.stderr
    assert time.monotonic() - t0 < 20
    holder = json.loads(od.lock_path(0).read_text())
    assert holder["pid"] == os.getpid()
    waiter = subprocess.Popen([sys.executable, "-m", "mmenc_cli", *map(str, encode_args(job_manifest, out, tiny_clip)),
                               "--wait-lock"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    assert waiter.poll() is None, "must wait while the lock is held"
    lock.release()
    _, err = waiter.communicate(timeout=300)
    assert waiter.returncode == 0, err


def test_stale_lock_of_a_dead_process_is_ignored(tmp_path: Path, job_manifest: Path, tiny_clip: Path) -> None:
    out = tmp_path / "out"
    od = OutDir(out)
    od.prepare()
    od.lock_path(0).write_text(json.dumps({"host": "elsewhere", "pid": 999999, "since": "yesterday"}))
    proc = mmenc(*encode_args(job_manifest, out, tiny_clip), "--limit", "3")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_cleanly_and_resumes(sig: int, code: int, tmp_path: Path, job_manifest: Path, tiny_clip: Path,
                                          clean_run: Path) -> None:
    out = tmp_path / "out"
    args = encode_args(job_manifest, out, tiny_clip)
    args[args.index("--shard-size") + 1] = "2"
    args[args.index("--batch-size") + 1] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "mmenc_cli", *map(str, args)], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    od = OutDir(out)
    deadline = time.monotonic() + 120
    while not od.shards() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert od.shards(), "no shard was committed"
    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "interrupted" in err
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"child processes left behind: {alive}"
    assert json.loads(od.task_meta_path(0).read_text())["state"] == "interrupted"
    assert not list((od.meta / "tmp").glob(".part-*"))
    again = mmenc(*args)
    assert again.returncode == 0, again.stderr
    assert_same_output(out, clean_run)


def test_two_devices_on_cpu(tmp_path: Path, job_manifest: Path, tiny_clip: Path, clean_run: Path) -> None:
    out = tmp_path / "out"
    args = encode_args(job_manifest, out, tiny_clip)
    args[args.index("--device") + 1] = "cpu,cpu"
    proc = mmenc(*args)
    assert proc.returncode == 0, proc.stderr
    workers = {p.name.split("-")[2] for p in OutDir(out).shards()}
    assert workers == {"w00", "w01"}
    assert_same_output(out, clean_run)
    meta = json.loads(OutDir(out).task_meta_path(0).read_text())
    assert meta["state"] == "done" and meta["devices"] == ["cpu", "cpu"]
