"""The `mmenc ray` driver's connect and signals: an address where nothing listens, or where a socket
accepts and never answers, ends in exit 3 naming the address within `--connect-timeout` (Ray alone
retries for many minutes); SIGTERM while connecting ends the driver at once (143); SIGTERM mid-job
does what the first Ctrl-C does (tasks cancelled, each recorded interrupted, a summary, exit 143)
and the same command then resumes to every id exactly once, in a bucket of the S3 server."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

from mmenc_cli.output import OutDir, read_json
from tests.engines.test_ray import DEMO, ENCODE, mmenc, ray_job, task_worker, texts, vectors
from tests.ray_cluster import require_ray
from tests.s3server import bucket, free_port, s3_server  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _ray() -> None:
    require_ray()


@pytest.fixture
def silent() -> Iterator[socket.socket]:
    """A listening socket on loopback that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock


def driver_to(address: str, *options: str, tmp: Path, background: bool = False) -> object:
    """`mmenc ray` of a one-row manifest to `address`."""
    manifest = texts(tmp / "m.jsonl", 1)
    return mmenc("ray", manifest, "--out", tmp / "out", "--tasks", "1", "--address", address, "--model", DEMO,
                 *options, "--", *ENCODE, background=background)


@pytest.mark.parametrize("where", ["closed", "silent"])
def test_an_address_that_does_not_answer_exits_3_naming_it(tmp_path: Path, where: str,
                                                           silent: socket.socket) -> None:
    port = free_port() if where == "closed" else silent.getsockname()[1]
    address = f"127.0.0.1:{port}"
    done = driver_to(address, "--connect-timeout", "3", tmp=tmp_path)  # subprocess.run's own timeout: 600 s
    assert done.returncode == 3, done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("mmenc: error:"))
    assert f"cannot reach the Ray cluster at {address}" in line, done.stderr
    assert ("no answer within 3 s (--connect-timeout)" if where == "silent" else "refused") in line
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_sigterm_while_connecting_ends_the_driver_at_once(tmp_path: Path, silent: socket.socket) -> None:
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    driver = driver_to(address, "--connect-timeout", "600", tmp=tmp_path, background=True)
    silent.settimeout(120)
    probe, _ = silent.accept()  # the driver is connecting
    probe.close()
    driver.send_signal(signal.SIGTERM)
    _, stderr = driver.communicate(timeout=120)  # not the 600 s of --connect-timeout
    assert driver.returncode == 143, stderr
    assert "stopped while connecting to the Ray cluster at " + address in stderr
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr


def task_states(od: OutDir) -> dict[int, str]:
    """Each task's recorded state."""
    states = {}
    for _, path in od.task_meta_paths():
        meta = read_json(path)
        if isinstance(meta, dict):
            states[int(meta["task"])] = str(meta.get("state"))
    return states


def test_sigterm_mid_job_cancels_the_tasks_and_the_same_command_resumes_exactly_once(
        tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 4500)
    out = f"s3://{bucket}/emb"
    od = OutDir(out)
    driver = ray_job(manifest, out, endpoint=s3_server, background=True)
    deadline = time.monotonic() + 180
    while task_worker(od, 2) is None:
        assert driver.poll() is None, f"the job ended before SIGTERM:\n{driver.stderr.read()}"
        assert time.monotonic() < deadline, "no task committed two shards in time"
        time.sleep(0.1)
    driver.send_signal(signal.SIGTERM)
    stdout, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 143, stderr
    assert "SIGTERM received" not in stderr and "Traceback" not in stderr  # Ray's crash dump, Ray's exit
    job = json.loads(stdout)
    assert job["exit_code"] == 143 and job["counters"]["encoded"] < 4500
    assert "interrupted" in {t["state"] for t in job["tasks"]}, job["tasks"]
    assert "re-run" in stderr  # the summary's reason
    states = task_states(od)
    assert "running" not in states.values() and "interrupted" in states.values(), states
    again = ray_job(manifest, out, endpoint=s3_server)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["status"]["all_done"]
    assert sorted(vectors(out)) == sorted(f"t{i}" for i in range(4500))  # each id once (vectors checks)
