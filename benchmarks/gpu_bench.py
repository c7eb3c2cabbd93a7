"""One-shot GPU benchmark of mmenc: images/s and texts/s against the forward-only limit and the
usual practice, each goal's figure printed beside it, in one run of about five minutes on one
H100, offline. Run it through gpu.sh:

    bash benchmarks/gpu.sh OUTDIR            # full: CUDA, bfloat16, batch 256
    bash benchmarks/gpu.sh --smoke OUTDIR    # tiny sizes on the CPU (CI: keeps this script alive)
    python benchmarks/gpu_bench.py OUTDIR [--smoke]

Stages (full sizes, smoke in brackets), each recorded in OUTDIR/gpu_bench.json as soon as it ends,
each wrapped so a failure records its error and the rest still run (exit 1 if any failed). The
goals' stages come first; the time guard (past GUARD_S) skips only the optional ones, and the
hard limit (HARD_S) kills a child that runs past it:
  facts         GPU name, library versions, usable CPUs (affinity and cgroup quota:
                mmenc_cli.cpus), free /dev/shm.
  jpegs         2,000 [16] unique photo-like JPEGs, quality 90, a quarter each at 640x480, 800x600,
                1024x768 and 500x375 (common.make_jpegs_parallel), listed again and again under
                new ids: 20,000 [48] rows for mmenc, and for the baseline as many as 9 of its waves
                take (a superset: the same ids first).
  models        random-weight CLIPs, image towers shaped as ViT-B/16 and ViT-L/14 [both tiny,
                224x224 input], saved in bfloat16 with CLIP's own image processor.
  limit_*       forward only: `get_image_features` on random pixels already on the device, batch
                256 [8], bfloat16 [float32], warm-up then timed between CUDA synchronizations.
  mmenc_*       mmenc's `run_encode` (its public API, gpu_children.py) on the JPEG rows: images/s
                = encoded / (elapsed - model load), and in steady state: the items of every batch
                group after the first over the time from the first group's vectors to the last's
                (a progress hook); model busy = CUDA-event forward seconds / loop seconds; peak
                GPU memory and the batch size as mmenc records them. B/16 with --decode gpu and
                fast, L/14 with fast (the goals); later B/16 exact and, optional, B/16 fast at
                mmenc's default batch size (the load-time probe's choice).
  text_model    a BERT shaped as all-MiniLM-L6-v2 [smaller] as a sentence-transformers folder,
                random weights, a synthetic 30,522-entry WordPiece vocabulary; 200,000 [500] texts.
  texts_st      SentenceTransformer(...).encode(texts, batch_size=256 [32]) after a warm-up batch;
                its first 4,096 vectors saved.
  texts_mmenc   mmenc on the texts, as mmenc_* (its vectors must agree with sentence-transformers').
  baseline_b16  the usual practice: a DataLoader with the usable CPUs less one workers (PIL + the
                model's CLIPImageProcessor per file, pin_memory on CUDA), vectors copied to the CPU
                per batch; /dev/shm checked before its workers start; images/s timed from the end
                of the first wave (a batch from every worker) over at least 8 more waves. Its
                vectors must agree with mmenc's B/16 gpu and fast runs' for the same ids.
  mmenc_b16_exact  --decode exact: its vectors must agree with the baseline's, and the gpu and
                fast runs' with its own.

Agreement: cosine >= 0.99 for every shared id, or the stage that compares fails. Every heavy
stage is its own process (gpu_children.py), so a CUDA fault in one cannot poison the others;
logs go to OUTDIR/logs. Goals are printed with their figures (gpu_report.py), never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

_USER_TOKENIZERS_PARALLELISM = os.environ.get("TOKENIZERS_PARALLELISM")  # before common sets it
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gpu_report  # noqa: E402

#: seconds since gpu.sh started (MMENC_GPU_BENCH_T0) past which no optional stage starts / children die
GUARD_S, HARD_S = 300.0, 540.0


@dataclass(frozen=True)
class Sizes:
    mode: str
    device: str
    dtype: str
    unique: int  # distinct JPEG files
    rows: int  # mmenc's image rows (the files again and again under new ids)
    texts: int
    batch: int
    text_batch: int
    clip: dict[str, str]  # role -> common.CLIP_SHAPES key
    text_shape: dict[str, Any] = field(default_factory=lambda: dict(common.MINILM_SHAPE))
    jpeg_sizes: tuple[tuple[int, int], ...] = ((640, 480), (800, 600), (1024, 768), (500, 375))
    jpeg_slice: int = 125
    limit_seconds: float = 2.0
    warmup: int = 3
    min_waves: int = 8  # the baseline's timed waves, at least
    baseline_workers: int = 0  # at most (0: the usable CPUs less one, as mmenc's default)
    keep_texts: int = 4096  # sentence-transformers' vectors kept for the agreement check
    guard_s: float = GUARD_S
    hard_s: float = HARD_S


FULL = Sizes("full", "cuda", "bfloat16", 2_000, 20_000, 200_000, 256, 256, {"b16": "b16", "l14": "l14"})
SMOKE = Sizes("smoke", "cpu", "float32", 16, 48, 500, 8, 32, {"b16": "tiny", "l14": "tiny"},
              text_shape={**common.MINILM_SHAPE, "hidden_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "intermediate_size": 128},
              jpeg_slice=4, limit_seconds=0.3, warmup=1, baseline_workers=2, guard_s=600.0, hard_s=900.0)


class Bench:
    """The run: its stages, their JSON record, the time guard and the child processes."""

    def __init__(self, outdir: Path, sizes: Sizes, t0: float) -> None:
        self.out, self.s, self.t0 = outdir, sizes, t0
        self.data = Path(os.environ["MMENC_BENCH_CACHE"]) if os.environ.get("MMENC_BENCH_CACHE") else outdir / "data"
        self.stages: dict[str, dict[str, Any]] = {}
        self.paths: dict[str, Path] = {}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), os.environ.get("PYTHONPATH")) if p)
        if _USER_TOKENIZERS_PARALLELISM is None:  # common set it; children run as a user would
            self.env.pop("TOKENIZERS_PARALLELISM", None)
        (outdir / "logs").mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def stage(self, name: str, fn: Callable[[], dict[str, Any]], needs: tuple[str, ...] = (),
              optional: bool = False) -> None:
        """Run one stage (an optional one only before the time guard) and record it."""
        missing = [n for n in needs if self.stages.get(n, {}).get("status") != "ok"]
        start = time.perf_counter()
        if missing:
            entry: dict[str, Any] = {"status": "skipped", "reason": f"needs {', '.join(missing)}"}
        elif optional and self.elapsed() > self.s.guard_s:
            entry = {"status": "skipped", "reason": f"time guard: {self.elapsed():.0f} s > {self.s.guard_s:.0f} s"}
        else:
            try:
                entry = {"status": "ok", **fn()}
            except Exception as e:  # noqa: BLE001 - one failing stage must not stop the others
                entry = {"status": "failed", "error": {"type": type(e).__name__, "message": str(e)[-4000:]}}
            entry["seconds"] = round(time.perf_counter() - start, 2)
        entry["at_s"] = round(self.elapsed(), 1)
        self.stages[name] = entry
        self.save()
        print(f"[{entry['at_s']:6.1f} s] {name:24s} {gpu_report.describe(name, entry)}", flush=True)

    def cpus(self) -> int | None:
        return self.stages.get("facts", {}).get("cpus")

    def save(self) -> None:
        doc = {"mode": self.s.mode, "sizes": asdict(self.s), "elapsed_s": round(self.elapsed(), 1),
               "data": str(self.data), "stages": self.stages,
               "summary": gpu_report.summary(self.stages, self.s.mode, self.cpus())}
        tmp = self.out / "gpu_bench.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.out / "gpu_bench.json")

    def proc(self, name: str, cmd: list[str]) -> str:
        """`cmd`'s stdout (stderr in logs/NAME.log), killed at the hard time limit."""
        logs = self.out / "logs"
        return common.run_logged(cmd, logs / f"{name}.out", logs / f"{name}.log", env=self.env,
                                 timeout=max(5.0, self.s.hard_s - self.elapsed()))

    def child(self, name: str, kind: str, model: Path, manifest: Path, batch: int, *extra: str) -> dict[str, Any]:
        cmd = [sys.executable, str(Path(__file__).with_name("gpu_children.py")), kind, "--model", str(model),
               "--manifest", str(manifest), "--device", self.s.device, "--dtype", self.s.dtype,
               "--batch-size", str(batch), "--seconds", str(self.s.limit_seconds), "--warmup", str(self.s.warmup),
               *extra]
        return common.last_json(self.proc(name, cmd), "BENCH-RESULT ")

    def mmenc(self, name: str, manifest: Path, model: Path, batch: int | None, decode: str | None, expected: int,
              unit: str) -> dict[str, Any]:
        """mmenc's `run_encode` in a child: its numbers (`mmenc_numbers`) and its output folder."""
        out = self.out / "runs" / name
        shutil.rmtree(out, ignore_errors=True)
        extra = ["--out", str(out), *(["--decode", decode] if decode else [])]
        wall = time.perf_counter()
        result = self.child(name, "mmenc", model, manifest, batch or 0, *extra)
        wall = time.perf_counter() - wall
        numbers = mmenc_numbers(result, expected, unit)
        self.paths[name] = out  # only a run that encoded everything is compared with others
        return {**numbers, "wall_s": round(wall, 2), "out": str(out), "decode": decode or "mmenc's default"}


def mmenc_numbers(r: dict[str, Any], expected: int, unit: str) -> dict[str, Any]:
    """Rates (whole run less model load; steady state), model-busy share, peak memory and batch
    size of one mmenc run's result."""
    c = r["counters"]
    seconds = c.get("seconds", {})
    if r.get("state") != "done" or c["encoded"] != expected:
        raise RuntimeError(f"mmenc encoded {c['encoded']} of {expected} (state {r.get('state')}, "
                           f"failed {c.get('failed')})")
    load = float(seconds.get("load") or 0.0)
    loop = float(r["elapsed"]) - load
    device = seconds.get("forward_device")
    return {"encoded": c["encoded"], f"{unit}_per_s": c["encoded"] / loop, "steady_per_s": r["steady"]["per_s"],
            "steady": r["steady"], "elapsed_s": r["elapsed"], "load_s": round(load, 3), "loop_s": round(loop, 3),
            "model_busy": device / loop if device is not None else None, "forward_device_s": device,
            "peak_gpu_bytes": (r.get("forward") or {}).get("peak_memory_bytes"), "batch_size": r.get("batch_size"),
            "batch_probe": (r.get("forward") or {}).get("batch_probe"), "mmenc_seconds": seconds}


# ------------------------------------------------------------------------------------ stages


def facts(b: Bench) -> dict[str, Any]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from mmenc_cli.cpus import cgroup_cpu_quota, usable_cpus

    cuda = torch.cuda.is_available()
    if b.s.device.startswith("cuda") and not cuda:
        raise RuntimeError("CUDA is not available to torch (full mode needs a GPU; --smoke runs on the CPU)")
    vers = {}
    for name in ("torch", "transformers", "torchvision", "sentence-transformers", "pillow", "pyarrow"):
        try:
            vers[name] = version(name)
        except PackageNotFoundError:
            vers[name] = None
    import mmenc_cli

    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None  # DataLoader batches pass through it
    return {"gpu": torch.cuda.get_device_name(0) if cuda else None, "cuda": torch.version.cuda,
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
            "dev_shm_free_bytes": shm.f_bavail * shm.f_frsize if shm else None, "device": b.s.device,
            "cpus": usable_cpus(), "affinity": len(os.sched_getaffinity(0)), "cgroup_quota": cgroup_cpu_quota(),
            "python": platform.python_version(), "versions": vers, "mmenc_cli": str(Path(mmenc_cli.__file__).parent),
            "tokenizers_parallelism": b.env.get("TOKENIZERS_PARALLELISM", "unset (library default)")}


def jpegs(b: Bench) -> dict[str, Any]:
    """The unique JPEGs, and the manifests that list them again under new ids."""
    per = -(-b.s.unique // len(b.s.jpeg_sizes))
    files: list[Path] = []
    for w, h in b.s.jpeg_sizes:
        files += common.make_jpegs_parallel(b.data / f"jpegs-{w}x{h}-q90", per, (w, h), 90, per_slice=b.s.jpeg_slice)
    files = files[: b.s.unique]
    # the sizes interleaved, so every batch holds each of them
    mixed = [files[i * per + k] for k in range(per) for i in range(len(b.s.jpeg_sizes)) if i * per + k < len(files)]
    workers = baseline_workers(b)
    baseline_rows = max(b.s.rows, (b.s.min_waves + 1) * workers * b.s.batch)

    def rows(n: int) -> Any:
        return ({"id": f"img{i:06d}", "image": str(mixed[i % len(mixed)].resolve())} for i in range(n))

    b.paths["images"] = common.write_manifest(b.out / "manifests" / f"images-{b.s.rows}.jsonl", rows(b.s.rows))
    b.paths["baseline"] = common.write_manifest(b.out / "manifests" / f"images-{baseline_rows}.jsonl",
                                                rows(baseline_rows))
    mib = sum(p.stat().st_size for p in mixed) / 2**20
    return {"unique": len(mixed), "sizes": [f"{w}x{h}" for w, h in b.s.jpeg_sizes], "quality": 90,
            "mean_kib": round(mib * 1024 / len(mixed), 1), "rows": b.s.rows, "baseline_rows": baseline_rows,
            "baseline_workers": workers, "manifest": str(b.paths["images"])}


def baseline_workers(b: Bench) -> int:
    """The DataLoader's workers: the usable CPUs less one (mmenc's default), capped in smoke mode."""
    from mmenc_cli.cpus import usable_cpus

    workers = max(1, usable_cpus() - 1)
    return min(workers, b.s.baseline_workers) if b.s.baseline_workers else workers


def quiet_transformers() -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()  # "Writing model shards" bars in the table


def models(b: Bench) -> dict[str, Any]:
    quiet_transformers()
    built = {}
    for role, shape in b.s.clip.items():
        b.paths[role] = common.make_clip(shape, root=b.data / "models", dtype="bfloat16")
        built[role] = {"shape": shape, **common.CLIP_SHAPES[shape], "path": str(b.paths[role])}
    return {"clip": built, "saved_dtype": "bfloat16"}


def text_model(b: Bench) -> dict[str, Any]:
    quiet_transformers()
    model = b.paths["minilm"] = common.make_minilm(b.data / "models", b.s.text_shape)
    texts = common.text_corpus(b.s.texts, vocab_file=model / "vocab.txt")
    rows = ({"id": f"t{i:07d}", "text": t} for i, t in enumerate(texts))
    b.paths["texts"] = common.write_manifest(b.out / "manifests" / f"texts-{len(texts)}.jsonl", rows)
    words = sum(len(t.split()) for t in texts) / len(texts)
    return {"shape": b.s.text_shape, "path": str(model), "texts": len(texts), "mean_words": round(words, 1),
            "vocab": "synthetic WordPiece (common.synthetic_vocab)"}


def limit(b: Bench, role: str) -> dict[str, Any]:
    return b.child(f"limit_{role}", "limit", b.paths[role], Path("-"), b.s.batch)


def mmenc_images(b: Bench, role: str, decode: str, batch: int | None = -1, name: str = "") -> dict[str, Any]:
    """mmenc on the JPEG rows; `batch` None: mmenc's default batch size (-1: the benchmark's)."""
    return b.mmenc(name or f"mmenc_{role}_{decode}", b.paths["images"], b.paths[role],
                   b.s.batch if batch == -1 else batch, decode, b.s.rows, "images")


def vectors(b: Bench, name: str, modality: str = "image") -> tuple[Any, Any]:
    """(ids, [n, dim]) of a run: an mmenc output read back, or a child's saved .npz."""
    import numpy as np

    if name in b.paths and b.paths[name].is_dir():
        from mmenc_cli import read_embeddings

        return read_embeddings(str(b.paths[name]), modality)
    saved = np.load(b.paths[name])
    return saved["ids"], saved["vectors"]


def agree(b: Bench, pairs: list[tuple[str, str]], modality: str = "image") -> dict[str, Any]:
    """Each pair's cosines over the ids both have (pairs whose runs did not both succeed: left out);
    RuntimeError when a pair disagrees."""
    ran = [(x, y) for x, y in pairs if x in b.paths and y in b.paths]
    found = {f"{x} vs {y}": gpu_report.cosines(vectors(b, x, modality), vectors(b, y, modality)) for x, y in ran}
    return {"agreement": gpu_report.check_agreement(found)} if found else {}


def baseline(b: Bench) -> dict[str, Any]:
    """The DataLoader baseline; its vectors against mmenc's gpu and fast runs'."""
    saved = b.out / "runs" / "baseline_b16.npz"
    saved.parent.mkdir(parents=True, exist_ok=True)
    r = b.child("baseline_b16", "baseline", b.paths["b16"], b.paths["baseline"], b.s.batch,
                "--vectors", str(saved), "--min-waves", str(b.s.min_waves), "--max-workers", str(b.s.baseline_workers))
    b.paths["baseline_b16"] = saved
    return {**r, **agree(b, [("mmenc_b16_gpu", "baseline_b16"), ("mmenc_b16_fast", "baseline_b16")])}


def mmenc_exact(b: Bench) -> dict[str, Any]:
    """mmenc B/16 --decode exact; its vectors against the baseline's, the other modes' against its own."""
    r = mmenc_images(b, "b16", "exact")
    return {**r, **agree(b, [("mmenc_b16_exact", "baseline_b16"), ("mmenc_b16_gpu", "mmenc_b16_exact"),
                             ("mmenc_b16_fast", "mmenc_b16_exact")])}


def texts_st(b: Bench) -> dict[str, Any]:
    saved = b.out / "runs" / "texts_st.npz"
    saved.parent.mkdir(parents=True, exist_ok=True)
    r = b.child("texts_st", "st", b.paths["minilm"], b.paths["texts"], b.s.text_batch,
                "--vectors", str(saved), "--keep", str(b.s.keep_texts))
    if r["encoded"] != b.s.texts:
        raise RuntimeError(f"sentence-transformers encoded {r['encoded']} of {b.s.texts}")
    b.paths["texts_st"] = saved
    return r


def texts_mmenc(b: Bench) -> dict[str, Any]:
    r = b.mmenc("texts_mmenc", b.paths["texts"], b.paths["minilm"], b.s.text_batch, None, b.s.texts, "texts")
    return {**r, **agree(b, [("texts_mmenc", "texts_st")], "text")}


def run_all(b: Bench) -> None:
    """The goals' stages first; the rest after them (only the last is left to the time guard)."""
    img = ("facts", "jpegs", "models")
    b.stage("facts", lambda: facts(b))
    b.stage("jpegs", lambda: jpegs(b), ("facts",))
    b.stage("models", lambda: models(b), ("facts",))
    b.stage("limit_b16", lambda: limit(b, "b16"), ("facts", "models"))
    b.stage("limit_l14", lambda: limit(b, "l14"), ("facts", "models"))
    b.stage("mmenc_b16_gpu", lambda: mmenc_images(b, "b16", "gpu"), img)
    b.stage("mmenc_b16_fast", lambda: mmenc_images(b, "b16", "fast"), img)
    b.stage("mmenc_l14_fast", lambda: mmenc_images(b, "l14", "fast"), img)
    b.stage("text_model", lambda: text_model(b), ("facts",))
    b.stage("texts_st", lambda: texts_st(b), ("text_model",))
    b.stage("texts_mmenc", lambda: texts_mmenc(b), ("text_model",))
    b.stage("baseline_b16", lambda: baseline(b), img)
    b.stage("mmenc_b16_exact", lambda: mmenc_exact(b), img)
    b.stage("mmenc_b16_default_batch", lambda: mmenc_images(b, "b16", "fast", None, "mmenc_b16_default_batch"),
            img, optional=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = ap.parse_args()
    t0 = float(os.environ.get("MMENC_GPU_BENCH_T0") or time.time())
    outdir = args.outdir.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(outdir, SMOKE if args.smoke else FULL, t0)
    run_all(bench)
    s = bench.s
    sys.exit(gpu_report.report(s.mode, s.device, s.dtype, s.batch, bench.elapsed(), str(outdir / "gpu_bench.json"),
                               str(outdir / "logs"), bench.stages, bench.cpus()))


if __name__ == "__main__":
    main()
