"""What a finished output costs to come back to: a re-run, `mmenc inspect` and `mmenc status` on an
output of many small shards.

    python benchmarks/bench_rerun.py [--shards 20000] [--small 2000] [--keep DIR]

Builds two outputs with the bundled demo model (texts only, `--shard-size 1`, so one shard per
row): one of `--shards` shards and one of `--small`, then times, as whole processes, the same
encode command again (nothing left to do), `mmenc inspect OUT` and `mmenc status OUT`. Prints the
seconds of each and the ratio big/small: a cost linear in the shards gives about shards/small,
a quadratic one its square.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(folder: Path, rows: int) -> tuple[list[str], Path]:
    """A JSONL of `rows` texts and the encode command that puts each in its own shard."""
    manifest = folder / "texts.jsonl"
    with open(manifest, "w") as fh:
        for i in range(rows):
            fh.write(json.dumps({"id": f"t{i}", "text": f"text number {i}"}) + "\n")
    out = folder / "out"
    cmd = [sys.executable, "-m", "mmenc_cli", "encode", str(manifest), "--out", str(out), "--modality", "text",
           "--shard-size", "1", "--progress", "none", "--workers", "0"]
    return cmd, out


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 4):
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.perf_counter() - t0


def measure(folder: Path, rows: int) -> dict[str, float]:
    folder.mkdir(parents=True, exist_ok=True)
    cmd, out = build(folder, rows)
    built = timed(cmd)
    cli = [sys.executable, "-m", "mmenc_cli"]
    return {"build": built, "rerun": timed(cmd), "inspect": timed([*cli, "inspect", str(out)]),
            "status": timed([*cli, "status", str(out)])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=20000)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--keep", type=Path, help="build the outputs here (kept) instead of a temp folder")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="mmenc-rerun-"))
    small = measure(root / "small", args.small)
    big = measure(root / "big", args.shards)
    print(f"{'':8} {args.small:>8} shards {args.shards:>8} shards   ratio (linear: {args.shards / args.small:.0f})")
    for name in ("build", "rerun", "inspect", "status"):
        print(f"{name:8} {small[name]:>13.2f} s {big[name]:>13.2f} s   {big[name] / small[name]:6.1f}")


if __name__ == "__main__":
    main()
