"""An output in an S3 bucket against a local one: encoding speed, and what a resume asks of the
store; images listed as s3:// URLs against the store's own GET rate.

    python benchmarks/bench_store.py [--texts 20000] [--shards 1000] [--images 2000] [--endpoint URL]
    python benchmarks/bench_store.py --only reads [--images 2000]

Starts moto's S3 server on localhost (or uses `--endpoint`, e.g. MinIO), then, in this process,
with the bundled demo model:
  1. encodes `--texts` texts into a local folder and into a bucket, twice each, alternating, and
     prints the best seconds of each and their ratio (local / bucket: 1.0 is as fast);
  2. builds an output of `--shards` shards in the bucket and re-runs the same encode (nothing left
     to do), counting the store requests by operation with botocore's event hooks; the same
     re-run on a local copy gives the baseline seconds;
  3. (reads) puts `--images` small JPEGs in a bucket, measures the store's own rate: 16 threads of
     plain GetObjects (botocore) reading every one, then encodes a manifest of their s3:// URLs
     (default decode workers), images/s over the whole run, and prints the ratio (target >= 0.8);
     the same encode in-process (`--workers 0`) counts the S3 calls per image with botocore's
     hooks (target 1 GetObject, nothing else), and where this script started moto, its access log
     counts the requests for the images in the run with workers.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CALLS: collections.Counter[str] = collections.Counter()


def count_calls() -> None:
    """Count every S3 API call of every botocore or s3fs client made from now on (`before-call`)."""
    from botocore.session import Session  # aiobotocore's sessions are made through botocore's

    original = Session.__init__

    def init(self: Any, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        self.register("before-call.s3", lambda event_name, **_: CALLS.update([event_name.rsplit(".", 1)[-1]]))

    Session.__init__ = init  # type: ignore[method-assign]


def start_server(log: Path | None = None) -> tuple[str, subprocess.Popen | None]:
    """moto's S3 server on a free port; its access log (one line per request) to `log` if given."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    errors = open(log, "wb") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=errors)
    for _ in range(300):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return f"http://127.0.0.1:{port}", proc
        time.sleep(0.1)
    raise SystemExit("moto server did not start")


def texts(path: Path, n: int) -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"t{i}", "text": f"text number {i}, a caption of a few words"}) + "\n")
    return path


def encode(manifest: Path, out: str, shard_size: int, modality: str = "text",
           workers: int | None = 0) -> tuple[float, dict[str, Any]]:
    from mmenc_cli import BatchConfig, ModelConfig, RunConfig, WriterConfig, run_encode

    cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(ROOT / "mmenc_cli" / "demo_model"),
                                                                  device="cpu"), modalities=(modality,),
                    writer=WriterConfig(out=out, shard_size=shard_size), batch=BatchConfig(workers=workers))
    t0 = time.perf_counter()
    result = run_encode(cfg)
    seconds = time.perf_counter() - t0
    if result.state != "done":
        raise SystemExit(f"{out}: {result.state}")
    return seconds, result.counters.to_dict()["modalities"][modality]


def writes(args: argparse.Namespace, bucket: str, tmp: Path) -> None:
    """Encoding texts into a bucket against a local folder; a resume's store calls."""
    import s3fs

    manifest = texts(tmp / "texts.jsonl", args.texts)
    best: dict[str, float] = {}
    for round in range(2):
        for where, out in (("local", str(tmp / f"local{round}")), ("bucket", f"s3://{bucket}/speed{round}")):
            seconds, _ = encode(manifest, out, 1000)
            best[where] = min(best.get(where, seconds), seconds)
    print(f"encode {args.texts} texts (shards of 1000): local {best['local']:.2f} s, bucket "
          f"{best['bucket']:.2f} s, speed bucket/local {best['local'] / best['bucket']:.2f}x")

    rows = texts(tmp / "resume.jsonl", args.shards * 20)
    out = f"s3://{bucket}/resume"
    built, _ = encode(rows, out, 20)
    CALLS.clear()
    seconds, counted = encode(rows, out, 20)
    calls = dict(sorted(CALLS.items()))
    assert counted["encoded"] == 0 and counted["encoded_before"] == args.shards * 20, counted
    local = tmp / "resume-local"
    s3fs.S3FileSystem().get(f"{bucket}/resume/", str(local), recursive=True)
    local_seconds, again = encode(rows, str(local), 20)
    assert again["encoded"] == 0, again
    print(f"resume over {args.shards} committed shards ({args.shards * 20} rows; built in {built:.1f} s): "
          f"{seconds:.2f} s in the bucket, {local_seconds:.2f} s on a local copy; store calls {calls}, "
          f"{sum(calls.values())} in all")


def put_images(bucket: str, n: int) -> list[str]:
    """`n` JPEGs of 160x160 noise (about 20 KB each) in `bucket`/img/; their keys."""
    import io

    import numpy as np
    import s3fs
    from PIL import Image

    rng = np.random.default_rng(0)
    objects = {}
    for k in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (160, 160, 3), dtype=np.uint8)).save(buf, "JPEG", quality=85)
        objects[f"{bucket}/img/{k:05d}.jpg"] = buf.getvalue()
    s3fs.S3FileSystem().pipe(objects)
    return [path.split("/", 1)[1] for path in objects]


def store_rate(endpoint: str, bucket: str, keys: list[str], threads: int = 16) -> float:
    """The store's own rate: objects/s read by `threads` threads of plain GetObjects (botocore)."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=threads))

    def get(key: str) -> int:
        return len(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        assert all(pool.map(get, keys))
    return len(keys) / (time.perf_counter() - t0)


def logged(log: Path | None, bucket: str, since: int) -> tuple[dict[str, int], int]:
    """Requests for `bucket`/img/ in moto's access log after byte `since`, by method; the log's end."""
    if log is None:
        return {}, 0
    data = log.read_bytes()
    methods = re.findall(rb'"([A-Z]+) /' + re.escape(bucket.encode()) + rb"/img/", data[since:])
    return dict(collections.Counter(m.decode() for m in methods)), len(data)


def reads(args: argparse.Namespace, endpoint: str, bucket: str, tmp: Path, log: Path | None) -> None:
    """Images listed as s3:// URLs against the store's own concurrent GET rate; requests per image."""
    keys = put_images(bucket, args.images)
    manifest, first = tmp / "images.jsonl", tmp / "first.jsonl"
    lines = [json.dumps({"id": f"i{k}", "image": f"s3://{bucket}/{key}"}) + "\n" for k, key in enumerate(keys)]
    manifest.write_text("".join(lines))
    first.write_text(lines[0])
    encode(first, str(tmp / "warm"), 1000, "image", workers=None)  # imports and caches warm, as in any later run
    store, ours, net, seen = 0.0, 0.0, 0.0, {}
    for round in range(2):  # alternating, best of each: the machine's noise hits both
        store = max(store, store_rate(endpoint, bucket, keys))
        start, _ = encode(first, str(tmp / f"first{round}"), 1000, "image", workers=None)
        _, since = logged(log, bucket, 0)
        seconds, counted = encode(manifest, str(tmp / f"images{round}"), 1000, "image", workers=None)
        assert counted["encoded"] == args.images, counted
        ours, net = max(ours, args.images / seconds), max(net, (args.images - 1) / max(1e-9, seconds - start))
        seen = logged(log, bucket, since)[0]
    CALLS.clear()
    _, counted = encode(manifest, str(tmp / "images-counted"), 1000, "image", workers=0)
    calls = {k: v / args.images for k, v in sorted(CALLS.items())}
    print(f"read {args.images} images from the bucket: the store's own rate {store:.0f} objects/s (16 threads of "
          f"GetObject); mmenc encode (default workers) {ours:.0f} images/s over the whole run, ratio "
          f"{ours / store:.2f}x; less a one-image run's {start:.2f} s (start and end) {net:.0f} images/s, ratio "
          f"{net / store:.2f}x. S3 calls per image {calls} (botocore hooks, --workers 0); requests for the "
          f"images in the store's log during the run with workers: {seen or 'not logged (--endpoint)'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=20000)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--only", choices=("writes", "reads"), help="run one side only")
    ap.add_argument("--endpoint", help="an S3 API server to use instead of starting moto")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mmenc-store-"))
    log = None if args.endpoint else tmp / "moto.log"
    endpoint, server = (args.endpoint, None) if args.endpoint else start_server(log)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
                      AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "bench"),
                      AWS_DEFAULT_REGION="us-east-1")
    count_calls()
    import s3fs

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(bucket)
    try:
        if args.only != "reads":
            writes(args, bucket, tmp)
        if args.only != "writes":
            reads(args, endpoint, bucket, tmp, log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    main()
