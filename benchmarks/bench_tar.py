"""Reading WebDataset tar shards: mmenc's reader against a plain `tarfile` stream loop.

    python benchmarks/bench_tar.py [--samples 1500] [--image-kb 200] [--runs 3]

Writes one shard of SAMPLES samples (a `jpg` member of IMAGE_KB random kilobytes and a `txt`
caption each) under a temporary folder, then, each in a fresh process, reads it whole:

- baseline: `tarfile.open(fileobj=..., mode="r|*")`, each member's bytes read (webdataset's way, and
  what a script of one's own does);
- mmenc: `readers.iter_rows` on the shard (samples grouped by key, validated rows).

It prints samples/s (the best of RUNS, the file in the page cache) and the peak resident set of
each process above its size before reading, and the ratios mmenc / baseline. Target: the memory
stays flat (a few MiB, not the shard's size) and the rate within 0.5x of the plain loop.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

READ = {
    "baseline": """
import tarfile
n = 0
with open(PATH, "rb") as fh, tarfile.open(fileobj=fh, mode="r|*") as tf:
    for m in tf:
        if m.isfile():
            tf.extractfile(m).read()
            n += 1
n //= 2
""",
    "mmenc": """
from mmenc_cli.config import ManifestConfig
from mmenc_cli.readers import iter_rows
n = sum(1 for _ in iter_rows([PATH], ManifestConfig(), 0, 1))
""",
}
WRAP = """
import resource, sys, time
PATH = sys.argv[1]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
{body}
secs = time.perf_counter() - t
print(n, secs, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def write_shard(path: Path, samples: int, image_kb: int) -> None:
    with tarfile.open(path, "w") as tf:
        for i in range(samples):
            for suffix, data in (("jpg", os.urandom(image_kb * 1024)), ("txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(f"{i:09d}.{suffix}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def measure(name: str, path: Path) -> tuple[int, float, float]:
    res = subprocess.run([sys.executable, "-c", WRAP.format(body=READ[name]), str(path)], capture_output=True,
                         text=True, check=True)
    n, secs, mib = res.stdout.split()
    return int(n), float(secs), float(mib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1500)
    ap.add_argument("--image-kb", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "00000.tar"
        write_shard(shard, args.samples, args.image_kb)
        print(f"shard: {args.samples} samples, {shard.stat().st_size / 2**20:.1f} MiB")
        best = {}
        for name in READ:
            runs = [measure(name, shard) for _ in range(args.runs)]
            assert all(n == args.samples for n, _, _ in runs), runs
            secs, mib = min(r[1] for r in runs), max(r[2] for r in runs)
            best[name] = (args.samples / secs, mib)
            print(f"{name:8s} {best[name][0]:10.0f} samples/s   peak +{mib:.1f} MiB")
    rate = best["mmenc"][0] / best["baseline"][0]
    print(f"mmenc / baseline: {rate:.2f}x samples/s, peak +{best['mmenc'][1]:.1f} vs +{best['baseline'][1]:.1f} MiB")


if __name__ == "__main__":
    main()
