"""Peak memory of `mmenc encode` for a small and a large text manifest: flat, not per row.

    python benchmarks/bench_memory.py [--rows 10000,1000000] [--batch-size 256] [--runs 1]
    python benchmarks/bench_memory.py --huge-line 300

With `--huge-line MB` it compares three manifests of 10,000 rows instead: as they are, with one
line of MB megabytes in the middle (over --max-row-bytes: one 413 row, read past without being
held), and with one 30 MB text (under the row limit: cut before tokenizing). Target: each peak
within 1.5x the plain manifest's.

Model: the tests' tiny sentence-transformers model (BERT hidden 32, 2 layers, random weights;
`tests/modelfactory.make_tiny_st`), so the run is dominated by mmenc's own per-row work. Each
manifest row is `{"id": "row-<n>", "text": <5-16 words>}`. mmenc runs as a whole process
(`python -m mmenc_cli encode ... --modality text`); the resident set size of that process plus
all its descendants (decode workers, when any) is sampled every 50 ms with psutil, and the peak
is reported per manifest with the difference to the smallest. Target: within 100 MB.

With `--tar NxMB,...` it measures media instead: for each pair it writes WebDataset tar shards
(500 members each) of N `jpg` members of MB megabytes (a 640x480 JPEG, a different one per member
of 16, padded after its end-of-image marker with random bytes to the size: what Pillow decodes
is the small image, what travels is MB), and runs `python -m mmenc_cli encode SHARDS --device cpu`
with the CLI's defaults (the bundled demo model, `--shard-size` 10000, default `--workers` and
`--max-inflight-bytes`), sampling the summed RSS of the encode process, the forkserver and the
decode workers every 50 ms. It prints each peak and its ratio to the first pair's run (the
baseline, same script). `--args "--shard-size 50"` appends options to every run. Target: peaks flat
in N and MB, 1500x1.4 under 1.5 GiB.

    python benchmarks/bench_memory.py --tar 500x1.4,1500x1.4,3000x1.4,150x25
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORDS = ["the", "a", "an", "photo", "of", "cat", "dog", "on", "in", "and", "is", "red", "blue", "car"]


def rows(n: int):
    """Deterministic short texts in the tiny tokenizer's vocabulary (no [UNK] noise)."""
    for i in range(n):
        k = 5 + (i * 7919) % 12
        words = [WORDS[(i * 31 + j * 17) % len(WORDS)] for j in range(k)]
        yield {"id": f"row-{i}", "text": f"{i} " + " ".join(words)}


def _at(samples: list[tuple[float, int]], frac: float) -> int:
    """The largest RSS sampled up to `frac` of the run's duration."""
    if not samples:
        return 0
    end = samples[-1][0] * frac
    return max(b for t, b in samples if t <= end) if samples[0][0] <= end else samples[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="10000,1000000", help="comma-separated manifest sizes")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--runs", type=int, default=1, help="runs per size (the median peak is reported)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--huge-line", type=int, default=None, metavar="MB", help="compare runs with one huge line")
    ap.add_argument("--tar", default=None, metavar="NxMB,...", help="peak RSS over tar shards of N members of MB")
    ap.add_argument("--args", default="", help="with --tar: options appended to every encode run")
    args = ap.parse_args()
    if args.huge_line:
        return huge_line(args)
    if args.tar:
        return tar_members(args)
    sizes = [int(s) for s in args.rows.split(",")]
    print(common.machine(args.device), flush=True)
    model = common.make_tiny_st()
    work = common.CACHE / "work-memory"
    print(f"model: tiny sentence-transformers ({model}); batch size {args.batch_size}; RSS of the mmenc "
          "process tree sampled every 50 ms", flush=True)
    peaks: dict[int, float] = {}
    for n in sizes:
        manifest = work / f"rows-{n}.jsonl"
        if not manifest.is_file():
            common.write_manifest(manifest, rows(n))
        runs = []
        for run in range(args.runs):
            r, note = common.quiet_run(lambda: common.run_mmenc(
                [str(manifest), "--model", str(model), "--modality", "text", "--batch-size", str(args.batch_size),
                 "--device", args.device], work / "out", sample_rss=0.05), lambda r: r.others, retries=0)
            assert r.items == n, f"expected {n} rows encoded, got {r.items}"
            runs.append(r)
            timeline = ", ".join(f"{_at(r.rss, f) / 2**20:.0f}" for f in (0.1, 0.25, 0.5, 0.75, 0.9, 1.0))
            print(f"  {n:>9,} rows run {run + 1}: peak RSS {r.peak_rss / 2**20:7.1f} MiB, wall {r.wall:6.1f} s, "
                  f"{n / r.wall:7.0f} rows/s end to end; seconds read {r.seconds['read']:.1f}, "
                  f"encode {r.seconds['encode']:.1f}, write {r.seconds['write']:.1f}; {note}\n"
                  f"      RSS MiB at 10/25/50/75/90/100% of the run: {timeline}", flush=True)
        peaks[n] = common.median([r.peak_rss for r in runs]) / 2**20
    base = sizes[0]
    print("\npeak RSS (parent + all children):")
    for n in sizes:
        print(f"  {n:>9,} rows: {peaks[n]:7.1f} MiB  ({peaks[n] - peaks[base]:+.1f} MiB vs {base:,} rows)")
    worst = max(peaks.values()) - min(peaks.values())
    print(f"spread {worst:.1f} MiB: target within 100 MB: {'met' if worst * 2**20 <= 100e6 else 'NOT met'}")


def with_line(path: Path, n: int, line: bytes) -> Path:
    """`n` ordinary rows with `line` in the middle, written without building it twice in memory."""
    if not path.is_file():
        with open(path, "wb") as fh:
            for i, row in enumerate(rows(n)):
                if i == n // 2:
                    fh.write(line)
                fh.write(json.dumps(row).encode() + b"\n")
    return path


def huge_line(args: argparse.Namespace) -> None:
    """Peak RSS with one huge line, or one huge text, against the same rows without it."""
    print(common.machine(args.device), flush=True)
    model, work, n = common.make_tiny_st(), common.CACHE / "work-memory", 10_000
    big = b'{"id": "huge", "text": "' + b"a cat on a mat " * (args.huge_line * (1 << 20) // 15) + b'"}\n'
    text = b'{"id": "long", "text": "' + b"a cat on a mat " * (30 * (1 << 20) // 15) + b'"}\n'
    manifests = {"plain": with_line(work / f"rows-{n}-plain.jsonl", n, b""),
                 f"one {args.huge_line} MB line": with_line(work / f"rows-{n}-huge-{args.huge_line}.jsonl", n, big),
                 "one 30 MB text": with_line(work / f"rows-{n}-text-30.jsonl", n, text)}
    del big, text
    peaks = {}
    for name, manifest in manifests.items():
        r, note = common.quiet_run(lambda: common.run_mmenc(
            [str(manifest), "--model", str(model), "--modality", "text", "--batch-size", str(args.batch_size),
             "--device", args.device], work / "out", sample_rss=0.05), lambda r: r.others, retries=0)
        peaks[name] = r.peak_rss / 2**20
        print(f"  {name:>20}: peak RSS {peaks[name]:7.1f} MiB, {r.items} encoded, wall {r.wall:.1f} s; {note}",
              flush=True)
    for name, peak in peaks.items():
        ratio = peak / peaks["plain"]
        print(f"  {name} / plain: {ratio:.2f}x" + ("" if name == "plain" else
                                                  f"; target <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'}"))


def write_tar_shards(folder: Path, n: int, size: int, per_shard: int = 500) -> list[Path]:
    """`n` samples of one `jpg` member of `size` bytes each, in shards of `per_shard` (cached by name)."""
    import io
    import random
    import tarfile

    import numpy as np

    shards = [folder / f"shard-{k:05d}.tar" for k in range((n + per_shard - 1) // per_shard)]
    if all(p.is_file() for p in shards):
        return shards
    folder.mkdir(parents=True, exist_ok=True)
    jpegs = [p.read_bytes() for p in common.make_jpegs(common.CACHE / "jpegs-640", 16)]
    pad = np.random.default_rng(0).bytes(size)  # random bytes: the tar and the page cache hold them as they are
    for k, path in enumerate(shards):
        tmp = path.with_suffix(".tmp")
        with tarfile.open(tmp, "w") as tf:
            for i in range(k * per_shard, min(n, (k + 1) * per_shard)):
                jpeg = jpegs[i % len(jpegs)]
                start = random.Random(i).randrange(0, len(pad) // 2)  # no two members alike
                data = jpeg + pad[start:start + max(0, size - len(jpeg))]
                data += pad[:max(0, size - len(data))]
                info = tarfile.TarInfo(f"{i:09d}.jpg")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
        tmp.rename(path)
    return shards


def tar_members(args: argparse.Namespace) -> None:
    """Peak RSS of the process tree over tar shards of N members of MB megabytes, per (N, MB)."""
    pairs = [(int(n), float(mb)) for n, mb in (p.lower().split("x") for p in args.tar.split(","))]
    print(common.machine(args.device), flush=True)
    work = common.CACHE / "work-memory"
    extra = args.args.split()
    print(f"model: the bundled demo model (CLIP, 64x64 input); options: defaults{' + ' + args.args if extra else ''};"
          " RSS of the mmenc process tree (encode process, forkserver, decode workers) sampled every 50 ms",
          flush=True)
    peaks = []
    for n, mb in pairs:
        size = int(mb * 1e6)
        shards = write_tar_shards(work / f"tar-{n}x{size}", n, size)
        pss = PssPeak()
        with pss:
            r, note = common.quiet_run(lambda: common.run_mmenc(
                [*map(str, shards), "--device", args.device, *extra], work / "out", sample_rss=0.05),
                lambda r: r.others, retries=0)
        assert r.items == n, f"expected {n} images encoded, got {r.items}"
        peaks.append((r.peak_rss / 2**20, pss.peak / 2**20))
        print(f"  {n:>5} x {mb:>5g} MB ({n * size / 2**30:5.2f} GiB of members): peak RSS {peaks[-1][0]:7.1f} MiB "
              f"({peaks[-1][0] / peaks[0][0]:.2f}x the first), peak PSS {peaks[-1][1]:7.1f} MiB, "
              f"wall {r.wall:6.1f} s; {note}", flush=True)
    print(f"\npeak summed RSS / PSS (encode process + forkserver + decode workers), RSS ratio to "
          f"{pairs[0][0]} x {pairs[0][1]:g} MB:")
    for (n, mb), (rss, pss_mib) in zip(pairs, peaks):
        print(f"  {n:>5} x {mb:>5g} MB: RSS {rss:7.1f} MiB  {rss / peaks[0][0]:.2f}x   PSS {pss_mib:7.1f} MiB")


class PssPeak:
    """The peak summed PSS of this process's descendants, sampled every 0.2 s on a thread: RSS
    counts the pages the decode workers share with the forkserver they fork from (torch's, once
    imported) in every process; PSS splits them, so its sum is what the tree really holds."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "PssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            total = 0
            for proc in psutil.Process().children(recursive=True):
                try:
                    with open(f"/proc/{proc.pid}/smaps_rollup", encoding="ascii") as fh:
                        total += next(int(line.split()[1]) * 1024 for line in fh if line.startswith("Pss:"))
                except (OSError, StopIteration, ValueError):
                    pass
            self.peak = max(self.peak, total)


if __name__ == "__main__":
    main()
