"""An output in an S3 bucket against a local one: encoding speed, and what a resume asks of the store.

    python benchmarks/bench_store.py [--texts 20000] [--shards 1000] [--endpoint URL]

Starts moto's S3 server on localhost (or uses `--endpoint`, e.g. MinIO), then, in this process,
with the bundled demo model:
  1. encodes `--texts` texts into a local folder and into a bucket, twice each, alternating, and
     prints the best seconds of each and their ratio (local / bucket: 1.0 is as fast);
  2. builds an output of `--shards` shards in the bucket and re-runs the same encode (nothing left
     to do), counting the store requests by operation with botocore's event hooks; the same
     re-run on a local copy gives the baseline seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CALLS: collections.Counter[str] = collections.Counter()


def count_calls() -> None:
    """Count every S3 API call of every s3fs client made from now on (botocore `before-call`)."""
    from aiobotocore.session import AioSession

    original = AioSession.__init__

    def init(self: Any, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        self.register("before-call.s3", lambda event_name, **_: CALLS.update([event_name.rsplit(".", 1)[-1]]))

    AioSession.__init__ = init  # type: ignore[method-assign]


def start_server() -> tuple[str, subprocess.Popen | None]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
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


def encode(manifest: Path, out: str, shard_size: int) -> tuple[float, dict[str, Any]]:
    from mmenc_cli import BatchConfig, ModelConfig, RunConfig, WriterConfig, run_encode

    cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(ROOT / "mmenc_cli" / "demo_model"),
                                                                  device="cpu"), modalities=("text",),
                    writer=WriterConfig(out=out, shard_size=shard_size), batch=BatchConfig(workers=0))
    t0 = time.perf_counter()
    result = run_encode(cfg)
    seconds = time.perf_counter() - t0
    if result.state != "done":
        raise SystemExit(f"{out}: {result.state}")
    return seconds, result.counters.to_dict()["modalities"]["text"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=20000)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--endpoint", help="an S3 API server to use instead of starting moto")
    args = ap.parse_args()
    endpoint, server = (args.endpoint, None) if args.endpoint else start_server()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
                      AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "bench"),
                      AWS_DEFAULT_REGION="us-east-1")
    count_calls()
    import s3fs

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(bucket)
    tmp = Path(tempfile.mkdtemp(prefix="mmenc-store-"))
    try:
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
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    main()
