"""Outputs in an object store (a real S3 API server on localhost, through s3fs): the same layout
and results as a local folder, exactly once across kills and concurrent runners, faults of the
store as faults of the output, no secret anywhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmenc_cli.output.embeddings import read_embeddings
from tests.s3server import KEY_ID, SECRET, bucket, proxy, s3_server, store_env  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "mmenc_cli" / "demo_model"
pytestmark = pytest.mark.slow


def texts(path: Path, n: int, empty_every: int = 0) -> Path:
    """`n` text rows; every `empty_every`-th text is empty (a 422 error row)."""
    with open(path, "w") as fh:
        for i in range(n):
            empty = empty_every and i % empty_every == empty_every - 1
            fh.write(json.dumps({"id": f"t{i}", "text": "" if empty else f"text number {i}"}) + "\n")
    return path


def mmenc(*args: Any, endpoint: str | None = None, check: bool = False, **kw: Any) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(store_env(endpoint) if endpoint else {})}
    done = subprocess.run([sys.executable, "-m", "mmenc_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, **kw)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def encode(manifest: Path, out: str, *extra: Any, endpoint: str | None = None, **kw: Any) -> subprocess.CompletedProcess:
    return mmenc("encode", manifest, "--out", out, "--modality", "text", "--shard-size", "40", "--progress",
                 "none", "--workers", "0", *extra, endpoint=endpoint, **kw)


def start_encode(manifest: Path, out: str, s3_server: str, stderr: Any = subprocess.DEVNULL) -> subprocess.Popen:
    """`encode` started in the background against the server (as `encode` runs it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **store_env(s3_server)}
    args = [sys.executable, "-m", "mmenc_cli", "encode", str(manifest), "--out", out, "--modality", "text",
            "--shard-size", "40", "--progress", "none", "--workers", "0"]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def wait_for_shards(bucket: str, n: int, seconds: float = 120) -> None:
    """Until `n` shards are committed under `bucket`/emb (a run is then mid-way)."""
    import s3fs

    fs, deadline = s3fs.S3FileSystem(), time.monotonic() + seconds
    while len(fs.glob(f"{bucket}/emb/part-*.parquet", refresh=True)) < n:
        assert time.monotonic() < deadline, f"no {n} shards after {seconds} s"
        time.sleep(0.2)


def vectors(out: str) -> dict[str, np.ndarray]:
    ids, matrix = read_embeddings(out, "text")
    assert len(ids) == len(set(ids)), "an id committed twice"
    return dict(zip(ids, matrix))


def error_summary(out: str, endpoint: str | None) -> dict[str, Any]:
    done = mmenc("errors", "summary", out, "--json", endpoint=endpoint, check=True)
    summary = json.loads(done.stdout)
    return {k: summary[k] for k in ("errors", "by_code", "by_reason")}


def test_an_output_in_a_bucket_is_the_same_as_a_local_one(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 200, empty_every=50)
    out = f"s3://{bucket}/emb"
    assert encode(manifest, out, endpoint=s3_server).returncode == 0
    assert encode(manifest, tmp_path / "local").returncode == 0
    got, want = vectors(out), vectors(str(tmp_path / "local"))
    assert got.keys() == want.keys() and len(got) == 196
    assert all(np.array_equal(got[k], want[k]) for k in want)
    import pandas as pd
    import pyarrow.dataset as ds
    import s3fs

    table = ds.dataset(out).to_table()  # pyarrow's own S3 client, through AWS_ENDPOINT_URL
    assert table.num_rows == 196 and set(table.column_names) == {"id", "modality", "embedding"}
    assert len(pd.read_parquet(out)) == 196
    assert error_summary(out, s3_server) == error_summary(str(tmp_path / "local"), None)
    for command in (("inspect", out), ("status", out), ("errors", "list", out),
                    ("errors", "retry", out, "-o", tmp_path / "retry.jsonl")):
        done = mmenc(*command, endpoint=s3_server)
        assert done.returncode == 0, (command, done.stderr)
    assert len((tmp_path / "retry.jsonl").read_text().splitlines()) == 4
    again = encode(manifest, out, "--json", endpoint=s3_server)
    counted = json.loads(again.stdout)["counters"]["modalities"]["text"]
    assert again.returncode == 0 and counted["encoded"] == 0 and counted["encoded_before"] == 196


def test_a_runner_killed_mid_run_resumes_to_the_clean_result(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 3000, empty_every=300)
    out = f"s3://{bucket}/emb"
    proc = start_encode(manifest, out, s3_server)
    wait_for_shards(bucket, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = encode(manifest, out, endpoint=s3_server)  # this host's killed run is no live runner
    assert done.returncode == 0, done.stderr
    assert encode(manifest, tmp_path / "clean").returncode == 0
    got, want = vectors(out), vectors(str(tmp_path / "clean"))
    assert got.keys() == want.keys()
    for key in want:  # batches of other texts pad differently: equal up to float noise
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0)
    assert error_summary(out, s3_server) == error_summary(str(tmp_path / "clean"), None)


def test_two_runners_of_one_task_one_goes_on_and_one_exits_75(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 3000)
    out = f"s3://{bucket}/emb"
    first = start_encode(manifest, out, s3_server)
    time.sleep(2.0)  # seconds apart, as the check starts them
    second = start_encode(manifest, out, s3_server, stderr=subprocess.PIPE)
    codes = [first.wait(600), second.wait(600)]
    said = second.stderr.read() if second.stderr else ""
    assert sorted(codes) == [0, 75], said
    assert codes[0] == 75 or "running" in said or "another runner" in said
    got = vectors(out)
    assert len(got) == 3000


def test_runners_started_at_once_never_both_commit(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 1500)
    out = f"s3://{bucket}/emb"
    procs = [start_encode(manifest, out, s3_server, stderr=subprocess.PIPE) for _ in range(2)]
    done = sorted((p.wait(600), p.stderr.read()) for p in procs if p.stderr)
    assert [code for code, _ in done] in ([0, 75], [0, 0]), done  # the first shard name both take settles it
    assert "failed" not in done[0][1]  # the loser stops: it records no failures of its own
    assert len(vectors(out)) == 1500


def test_throttling_is_retried_and_nothing_is_lost(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 200)
    with proxy(s3_server, "slowdown", count=6) as p:
        done = encode(manifest, f"s3://{bucket}/emb", endpoint=f"http://127.0.0.1:{p.server_port}")
        assert p.injected == 6
    assert done.returncode == 0, done.stderr
    assert len(vectors(f"s3://{bucket}/emb")) == 200


def test_a_bucket_that_refuses_writes_is_exit_3(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 20)
    with proxy(s3_server, "readonly") as p:
        done = encode(manifest, f"s3://{bucket}/emb", endpoint=f"http://127.0.0.1:{p.server_port}")
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert "not writable" in done.stderr or "AccessDenied" in done.stderr or "denied" in done.stderr.lower()


def test_a_store_without_exclusive_create_is_refused_unless_single_writer(tmp_path: Path, bucket: str,
                                                                         s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 20)
    with proxy(s3_server, "no-exclusive") as p:
        endpoint = f"http://127.0.0.1:{p.server_port}"
        refused = encode(manifest, f"s3://{bucket}/emb", endpoint=endpoint)
        assert refused.returncode == 3 and "--single-writer" in refused.stderr
        allowed = encode(manifest, f"s3://{bucket}/emb", "--single-writer", endpoint=endpoint)
    assert allowed.returncode == 0, allowed.stderr
    assert len(vectors(f"s3://{bucket}/emb")) == 20


def test_a_store_without_its_filesystem_stops_at_once(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl", 5)
    for url, package in (("gs://bucket/emb", "gcsfs"), ("az://container/emb", "adlfs")):
        done = encode(manifest, url)
        assert done.returncode == 3 and package in done.stderr, done.stderr
        assert not (ROOT / (url.split(":")[0] + ":")).exists()  # never a local folder named after the scheme
    assert encode(manifest, "ftp://host/emb").returncode == 3


def test_no_secret_reaches_the_output_or_the_logs(tmp_path: Path, bucket: str, s3_server: str) -> None:
    import s3fs

    manifest = texts(tmp_path / "m.jsonl", 50, empty_every=10)
    out = f"s3://{bucket}/emb"
    done = encode(manifest, out, "--json", "--verbose", "--storage-option", f"key={KEY_ID}",
                  "--storage-option", f"secret={SECRET}", endpoint=s3_server)
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    fs = s3fs.S3FileSystem()
    for key in fs.find(f"{bucket}/emb"):
        assert SECRET.encode() not in fs.cat(key), key
    script = mmenc("slurm", manifest, "--out", out, "--tasks", "2", "--script", "-", "--", "--modality", "text",
                   endpoint=s3_server)
    assert script.returncode == 0 and SECRET not in script.stdout + script.stderr
    for given in ([f"--storage-option=secret={SECRET}"], ["--storage-option", f"key={KEY_ID}"]):
        refused = mmenc("slurm", manifest, "--out", out, "--tasks", "2", "--script", "-", "--", *given)
        assert refused.returncode == 2 and "credential" in refused.stderr and SECRET not in refused.stdout


def test_credentials_the_store_refuses_are_exit_3(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 5)
    done = encode(manifest, f"s3://{bucket}/emb", "--storage-option", "secret=only-half", endpoint=s3_server)
    assert done.returncode == 3 and "internal error" not in done.stderr, done.stderr
    assert "only-half" not in done.stderr


def test_wait_lock_and_overwrite_in_a_bucket(tmp_path: Path, bucket: str, s3_server: str) -> None:
    import s3fs

    manifest = texts(tmp_path / "m.jsonl", 2000)
    out = f"s3://{bucket}/emb"
    first = start_encode(manifest, out, s3_server)
    wait_for_shards(bucket, 1)
    fs = s3fs.S3FileSystem()
    waited = encode(manifest, out, "--wait-lock", "--json", endpoint=s3_server, timeout=600)  # the heartbeat holds it
    assert first.wait(600) == 0 and waited.returncode == 0, waited.stderr
    counted = json.loads(waited.stdout)["counters"]["modalities"]["text"]
    assert counted["encoded"] == 0 and counted["encoded_before"] == 2000  # it began when the first had ended
    shards = sorted(fs.glob(f"{bucket}/emb/part-*.parquet", refresh=True))
    fs.pipe(f"{bucket}/emb/notes.txt", b"mine")
    again = encode(manifest, out, "--overwrite", "--json", endpoint=s3_server)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["counters"]["modalities"]["text"]["encoded"] == 2000
    assert sorted(fs.glob(f"{bucket}/emb/part-*.parquet", refresh=True)) == shards  # the same names, written anew
    assert fs.cat(f"{bucket}/emb/notes.txt") == b"mine" and len(vectors(out)) == 2000


def test_memory_and_file_urls_hold_an_output(tmp_path: Path) -> None:
    from mmenc_cli import ModelConfig, RunConfig, WriterConfig, run_encode

    manifest = texts(tmp_path / "m.jsonl", 50, empty_every=10)
    got = {}
    for out in (f"memory://mmenc-test-{uuid.uuid4().hex[:8]}/emb", f"file://{tmp_path}/file-url", str(tmp_path / "plain")):
        for _ in range(2):  # the second run finds everything committed
            cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(DEMO), device="cpu"),
                            writer=WriterConfig(out=out, shard_size=20))
            result = run_encode(cfg)
        text = result.counters.to_dict()["modalities"]["text"]
        assert (text["encoded"], text["encoded_before"]) == (0, 45)
        got[out] = vectors(out)
    first, *others = got.values()
    assert all(o.keys() == first.keys() and all(np.array_equal(o[k], first[k]) for k in first) for o in others)
    assert (tmp_path / "file-url" / "_mmenc" / "run.json").is_file() and not Path("file:").exists()


def test_a_killed_runs_unfinished_upload_is_aborted_at_the_next_start(tmp_path: Path, bucket: str,
                                                                      s3_server: str) -> None:
    import s3fs

    manifest = texts(tmp_path / "m.jsonl", 20)
    fs = s3fs.S3FileSystem()
    started = []  # what a run killed during a multipart upload leaves: invisible, billed
    for key in ("emb/part-t00000-w00-000000.parquet", "emb/part-t00001-w00-000000.parquet"):
        started.append(fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"])
        fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=started[-1], PartNumber=1, Body=b"x" * 1024)
    assert encode(manifest, f"s3://{bucket}/emb", endpoint=s3_server).returncode == 0
    left = fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == ["emb/part-t00001-w00-000000.parquet"]  # task 1's is not task 0's to abort
    assert len(vectors(f"s3://{bucket}/emb")) == 20
