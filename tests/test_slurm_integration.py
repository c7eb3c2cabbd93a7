"""`mmenc slurm --submit` on a real one-node Slurm cluster (.ci/slurm/up.sh): a 3-task array equals a
single-process run; a task killed with SIGKILL, then one stopped with SIGTERM (what --signal=B:TERM@N does
before the time limit), resume when re-submitted alone with `sbatch --array=1 SCRIPT`.

Skipped when Slurm is unavailable, failed instead under CI=true (tests/slurm_cluster.require_slurm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from mmenc_cli.output import OutDir, parse_shard_name, read_json
from tests.conftest import make_image, write_jsonl
from tests.slurm_cluster import TERMINAL_STATES, job_states, require_slurm, run_sbatch, wait_for_job_states
from tests.runs import embeddings

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
ENCODE = ["--device", "cpu", "--workers", "0", "--batch-size", "4", "--shard-size", "4", "--progress", "none"]
RESOURCES = ["--gpus-per-task", "0", "--cpus-per-task", "1", "--mem", "500M"]


@pytest.fixture(scope="session", autouse=True)
def _slurm() -> None:
    """Before anything else (session scope: before the tiny model is built): skip, or fail under CI=true."""
    require_slurm()


@pytest.fixture
def jobs() -> Iterator[list[str]]:
    """Job ids to cancel if a test ends early."""
    ids: list[str] = []
    yield ids
    for job in ids:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)


def mmenc(*args: Any, cwd: Path, check: bool = True, background: bool = False) -> Any:
    """Run `python -m mmenc_cli ARGS` from this checkout (the Slurm job inherits the environment)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "mmenc_cli", *map(str, args)]
    if background:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stderr[-3000:]}"
    return res


def finish(proc: subprocess.Popen) -> None:
    """Wait for a background run; it must succeed."""
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def assert_same_vectors(out: Path, ref: Path) -> dict[tuple[str, str], np.ndarray]:
    """Every (id, modality) exactly once in `out` (embeddings() asserts it), and equal to `ref`."""
    got, want = embeddings(out), embeddings(ref)
    assert set(got) == set(want)
    for key, vec in want.items():
        np.testing.assert_allclose(got[key], vec, rtol=0, atol=1e-6, err_msg=str(key))
    return got


def logs_of(out: Path, job: str) -> str:
    """The tails of a job's task logs, for failure messages."""
    logs = sorted((OutDir(out).meta / "logs").glob(f"{job}_*.out"))
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs)


def test_array_equals_single_process_run(tmp_path: Path, tiny_clip: Path, jobs: list[str]) -> None:
    base = tmp_path / "data dir 'q'"
    (base / "img").mkdir(parents=True)
    rows = []
    for i in range(30):
        image = f"img/i{i}.png" if i not in (2, 27) else f"img/missing {i}.png"  # first and last third fail
        if i not in (2, 27):
            make_image(base / image, (24 + i, 20 + i), seed=i)
        rows.append({"id": f"r{i:02d}", "image": image, "text": f"a photo of thing {i}"})
    manifest = write_jsonl(base / "manifest.jsonl", rows)
    out, ref = base / "out \"x\" 'y'", tmp_path / "ref"

    reference = mmenc("encode", manifest, "--out", ref, "--model", tiny_clip, *ENCODE, cwd=tmp_path, background=True)
    res = mmenc("slurm", manifest, "--out", out, "--model", tiny_clip, "--tasks", 3, *RESOURCES, "--submit",
                "--", *ENCODE, cwd=tmp_path)
    job = res.stdout.strip()
    assert job.isdigit(), res.stdout
    jobs.append(job)
    states = wait_for_job_states(job, timeout=180)
    assert set(states.values()) == {"COMPLETED"}, f"{states}\n{logs_of(out, job)}"
    finish(reference)

    # logs where --output said, despite the quotes and spaces in the path
    assert sorted(p.name for p in (OutDir(out).meta / "logs").iterdir()) == [f"{job}_{i}.out" for i in range(3)]
    got = assert_same_vectors(out, ref)
    assert set(got) == {(r["id"], m) for r in rows for m in ("image", "text")} - {("r02", "image"), ("r27", "image")}
    od = OutDir(out)
    assert {read_json(p)["task"] for _, p in od.task_meta_paths()} == {0, 1, 2}
    assert {parse_shard_name(s.name).task for s in od.shards()} == {0, 1, 2}  # type: ignore[union-attr]

    summary = json.loads(mmenc("errors", "summary", out, "--json", cwd=tmp_path).stdout)
    assert summary["errors"] == 2 and summary["by_task"] == {"0": 1, "2": 1}
    assert summary["by_modality"] == {"image": 2}
    status = json.loads(mmenc("status", out, "--json", cwd=tmp_path).stdout)
    assert status["all_done"] is True and status["rerun"] == [] and status["duplicates"]["count"] == 0
    assert [t["errors"] for t in status["tasks"]] == [1, 0, 1]


def padded_rows(prefix: str, n: int, size: int) -> list[dict[str, Any]]:
    """n cheap text rows whose JSONL takes exactly `size` bytes (a `pad` field takes the slack)."""
    rows = [{"id": f"{prefix}{i}", "text": f"short text {prefix} {i}", "pad": ""} for i in range(n)]
    slack = size - sum(len(json.dumps(r)) + 1 for r in rows)
    assert slack >= 0
    for i, r in enumerate(rows):
        r["pad"] = "x" * (slack // n + (1 if i < slack % n else 0))
    return rows


def task1_shards(od: OutDir) -> int:
    """Committed shards of task 1."""
    return sum(1 for s in od.shards() if s.name.startswith("part-t00001-"))


def wait_for_task1_shard(od: OutDir, job: str, more_than: int) -> None:
    """Poll until task 1 committed more than `more_than` shards (it must not finish first)."""
    deadline = time.monotonic() + 150
    while task1_shards(od) <= more_than:
        state = job_states(job).get(f"{job}_1", "PENDING")
        assert state not in TERMINAL_STATES, f"task 1 ended ({state}) before a new shard\n{logs_of(od.root, job)}"
        assert time.monotonic() < deadline, "task 1 committed no shard in time"
        time.sleep(0.2)


def exit_code(job: str) -> str:
    """Slurm's ExitCode=status:signal of a job or array task."""
    res = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    return res.stdout.split("ExitCode=", 1)[1].split()[0]


def test_killed_task_resumes_when_resubmitted(tmp_path: Path, tiny_clip: Path, jobs: list[str]) -> None:
    # Tasks split the manifests' bytes in thirds; three files of equal size give task i file i. Task 1's
    # file holds many rows with large images (slow to decode), the others a few padded text rows.
    base = tmp_path / "kill 'me'"
    base.mkdir()
    for k in range(3):
        make_image(base / f"big{k}.png", (1200, 1000), seed=k)
    slow = [{"id": f"s{i:03d}", "image": f"big{i % 3}.png", "text": f"slow row {i}"} for i in range(90)]
    m1 = write_jsonl(base / "m1.jsonl", slow)
    size = m1.stat().st_size
    m0 = write_jsonl(base / "m0.jsonl", padded_rows("a", 5, size))
    m2 = write_jsonl(base / "m2.jsonl", padded_rows("c", 5, size))
    assert m0.stat().st_size == m2.stat().st_size == size
    out, ref, script = base / "out", tmp_path / "ref", base / "encode job.sbatch"
    encode = ["--device", "cpu", "--workers", "0", "--batch-size", "2", "--shard-size", "2", "--progress", "none"]
    mmenc("slurm", m0, m1, m2, "--out", out, "--model", tiny_clip, "--tasks", 3, *RESOURCES, "--script", script,
          "--", *encode, cwd=tmp_path)
    od = OutDir(out)

    # 1. SIGKILL to the batch shell, which is mmenc (exec). (`scancel --signal=KILL` without --batch is a
    #    cancel in Slurm: SIGTERM first, SIGKILL only after KillWait; mmenc would stop cleanly.)
    job = run_sbatch(script, cwd=tmp_path)
    jobs.append(job)
    wait_for_task1_shard(od, job, 0)
    live = json.loads(mmenc("status", out, "--json", cwd=tmp_path, check=False).stdout)["tasks"][1]
    assert live["running"] is True and live["needs_rerun"] is False  # its lock is held by the job
    subprocess.run(["scancel", "--signal=KILL", "--batch", f"{job}_1"], check=True, timeout=30)
    states = wait_for_job_states(job, timeout=150)
    assert states[f"{job}_0"] == states[f"{job}_2"] == "COMPLETED", states
    assert states[f"{job}_1"] != "COMPLETED", states
    meta = read_json(od.task_meta_path(1))
    assert meta["state"] == "running"  # it died mid-run: the process is gone, its lock is free
    stat = Path(f"/proc/{meta['pid']}/stat")
    assert not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"
    res = mmenc("status", out, "--json", cwd=tmp_path, check=False)
    assert res.returncode == 4
    status = json.loads(res.stdout)
    assert status["rerun"] == [1] and not status["all_done"]
    assert status["tasks"][1]["running"] is False and "crashed" in status["tasks"][1]["reason"]
    killed = task1_shards(od)

    # 2. Re-submit task 1 alone; SIGTERM its batch shell as --signal=B:TERM@N does before the time limit:
    #    mmenc commits whole shards and exits 143, its task 'interrupted'.
    again = run_sbatch(script, "--array=1", cwd=tmp_path)
    jobs.append(again)
    wait_for_task1_shard(od, again, killed)
    subprocess.run(["scancel", "--signal=TERM", "--batch", f"{again}_1"], check=True, timeout=30)
    assert wait_for_job_states(again, timeout=150) == {f"{again}_1": "FAILED"}
    assert exit_code(f"{again}_1") == "143:0", logs_of(out, again)
    assert read_json(od.task_meta_path(1))["state"] == "interrupted"
    status = json.loads(mmenc("status", out, "--json", cwd=tmp_path, check=False).stdout)
    assert status["rerun"] == [1] and status["tasks"][1]["reason"] == "interrupted"
    stopped = task1_shards(od)

    # 3. Re-submit once more; meanwhile the reference runs in one process
    reference = mmenc("encode", m0, m1, m2, "--out", ref, "--model", tiny_clip, *encode, cwd=tmp_path,
                      background=True)
    last = run_sbatch(script, "--array=1", cwd=tmp_path)
    jobs.append(last)
    assert wait_for_job_states(last, timeout=150) == {f"{last}_1": "COMPLETED"}, logs_of(out, last)
    finish(reference)
    meta = read_json(od.task_meta_path(1))
    assert meta["state"] == "done"
    before = sum(m["encoded_before"] for m in meta["counters"]["modalities"].values())
    assert before == 2 * stopped > 2 * killed > 0  # both earlier runs' shards (2 rows each) were kept, not redone
    got = assert_same_vectors(out, ref)
    assert len(got) == 90 * 2 + 10
    status = json.loads(mmenc("status", out, "--json", cwd=tmp_path).stdout)
    assert status["all_done"] is True and status["duplicates"]["count"] == 0


def test_array_over_a_brace_range_of_tar_shards_and_a_folder(tmp_path: Path, tiny_clip: Path,
                                                             jobs: list[str]) -> None:
    """Shards named by a quoted brace range (expanded by each task, not by a shell), whole shards per
    task, and a folder spread over the tasks: the array equals one process, the missing shard is
    reported once."""
    from tests.readers.test_inputs import sample, write_tar

    shards = tmp_path / "shards"
    shards.mkdir()
    for n in range(5):
        write_tar(shards / f"{n:05d}.tar", [m for i in range(2 + n % 2) for m in sample(f"s{n}-{i}", n + i)])
    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(7):
        make_image(photos / f"p{i}.png", (20 + i, 24), seed=i)
    inputs = [str(shards / "{00000..00005}.tar"), photos]  # 00005.tar does not exist
    out, ref = tmp_path / "out", tmp_path / "ref"
    reference = mmenc("encode", *inputs, "--out", ref, "--model", tiny_clip, *ENCODE, cwd=tmp_path, background=True)
    res = mmenc("slurm", *inputs, "--out", out, "--model", tiny_clip, "--tasks", 3, *RESOURCES, "--submit",
                "--", *ENCODE, cwd=tmp_path)
    job = res.stdout.strip()
    jobs.append(job)
    states = wait_for_job_states(job, timeout=180)
    assert set(states.values()) == {"COMPLETED"}, f"{states}\n{logs_of(out, job)}"
    finish(reference)
    got = assert_same_vectors(out, ref)
    assert len({key for key in got if key[0].startswith("s")}) == 2 * 12 and len(got) == 2 * 12 + 7
    summary = json.loads(mmenc("errors", "summary", out, "--json", cwd=tmp_path).stdout)
    assert summary["errors"] == 1
    tasks = [read_json(p)["counters"] for _, p in OutDir(out).task_meta_paths()]
    assert sum(c["rows"] for c in tasks) == 12 + 1 + 7 and all(c["rows"] for c in tasks)
