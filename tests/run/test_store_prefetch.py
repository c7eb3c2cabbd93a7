"""A run over images listed as s3:// URLs (a real S3 API server on localhost, behind a proxy that
records every request): one GET per image and no other request for it, many GETs in flight in a
single decode worker, failures as error rows with their codes, every item accounted for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mmenc_cli.output.embeddings import read_embeddings
from tests.media.store_faults import jpeg, read_proxy
from tests.s3server import bucket, s3_server, store_env  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "mmenc_cli" / "demo_model"
pytestmark = pytest.mark.slow


def mmenc(*args: Any, endpoint: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **store_env(endpoint)}
    return subprocess.run([sys.executable, "-m", "mmenc_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def put_images(bucket: str, n: int) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem()
    for k in range(n):
        fs.pipe(f"{bucket}/img/{k:03d}.jpg", jpeg(k))
    return [f"s3://{bucket}/img/{k:03d}.jpg" for k in range(n)]


def manifest(path: Path, urls: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"i{k}", "image": url}) + "\n" for k, url in enumerate(urls)))
    return path


def encode(rows: Path, out: Path, endpoint: str, *extra: Any) -> dict[str, Any]:
    done = mmenc("encode", rows, "--model", DEMO, "--out", out, "--modality", "image", "--progress", "none",
                 "--json", "--shard-size", "16", *extra, endpoint=endpoint)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["counters"]["modalities"]["image"]


@pytest.mark.parametrize("workers", ["1", "0"])
def test_images_in_a_bucket_are_fetched_many_at_once_one_get_each(tmp_path: Path, bucket: str, s3_server: str,
                                                                    workers: str) -> None:
    urls = put_images(bucket, 40)
    rows = manifest(tmp_path / "m.jsonl", urls)
    with read_proxy(s3_server, delay=0.05) as proxy:  # every GET held 50 ms: those in flight overlap
        counted = encode(rows, tmp_path / "out", proxy.url, "--workers", workers, "--batch-size", "16")
        image_requests = [(m, p) for m, p in proxy.requests if "/img/" in p]
    assert counted["encoded"] == 40 and not counted["failed"]
    assert sorted(image_requests) == sorted(("GET", f"/{bucket}/img/{k:03d}.jpg") for k in range(40))
    assert proxy.most_gets > 1  # a worker waits for many GETs at once, not one after another
    ids, vectors = read_embeddings(str(tmp_path / "out"), "image")
    assert sorted(ids) == sorted(f"i{k}" for k in range(40)) and vectors.shape[0] == 40


def test_store_failures_are_error_rows_and_the_run_goes_on(tmp_path: Path, bucket: str, s3_server: str) -> None:
    import s3fs

    urls = put_images(bucket, 6)
    s3fs.S3FileSystem().pipe(f"{bucket}/img/big.jpg", b"\xff" * 5000)
    listed = [*urls[:2], f"s3://{bucket}/img/missing.jpg", f"s3://{bucket}/img/secret.jpg", urls[2],
              f"s3://{bucket}/img/slow.jpg", f"s3://{bucket}/img/big.jpg", *urls[3:]]
    s3fs.S3FileSystem().pipe(f"{bucket}/img/secret.jpg", jpeg(7))
    s3fs.S3FileSystem().pipe(f"{bucket}/img/slow.jpg", jpeg(8))
    rows = manifest(tmp_path / "m.jsonl", listed)
    with read_proxy(s3_server, faults={"secret.jpg": [403] * 50, "slow.jpg": [503]}) as proxy:
        counted = encode(rows, tmp_path / "out", proxy.url, "--workers", "1", "--max-file-bytes", "4000")
        assert proxy.count("GET", "slow.jpg") == 2 and proxy.count("HEAD") == 0
    assert counted["encoded"] == 7 and sum(counted["failed"].values()) == 3
    done = mmenc("errors", "list", tmp_path / "out", "--json", endpoint=s3_server)
    assert done.returncode == 0, done.stderr
    errors = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    rows_by_id = {r["id"]: (r["code"], r["reason"], r["stage"]) for r in errors}
    assert rows_by_id == {"i2": (404, "media.not_found", "load"), "i3": (403, "media.permission_denied", "load"),
                          "i6": (413, "media.file_too_large", "load")}
