"""One-shot GPU benchmark of mmenc: images/s and texts/s against the forward-only limit and the
usual practice, in one run of under 4 minutes on one H100, offline. Run it through gpu.sh:

    bash benchmarks/gpu.sh OUTDIR            # full: CUDA, bfloat16, batch 256
    bash benchmarks/gpu.sh --smoke OUTDIR    # tiny sizes on the CPU (CI: keeps this script alive)
    python benchmarks/gpu_bench.py OUTDIR [--smoke]

Stages (full sizes, smoke in brackets), each recorded in OUTDIR/gpu_bench.json as soon as it ends,
each wrapped so a failure records its error and the rest still run (exit 1 if any failed); a
time guard skips the stages left once the run is past GUARD_S:
  facts         GPU name, library versions, usable CPUs.
  jpegs         10,000 [48] photo-like 640x480 JPEGs, quality 90 (common.make_jpegs_parallel).
  models        random-weight CLIPs, image towers shaped as ViT-B/16 and ViT-L/14 [both tiny,
                224x224 input], saved in bfloat16 with CLIP's own image processor.
  limit_*       forward only: `get_image_features` on random pixels already on the device, batch
                256 [8], bfloat16 [float32], warm-up then timed between CUDA synchronizations.
  mmenc_*       `python -m mmenc_cli encode` on a JSONL manifest of the JPEGs; images/s =
                encoded / (elapsed - model load) from its --json result; model busy = its CUDA-event
                forward seconds / the same loop seconds; peak GPU memory as it reports it.
                B/16 with --decode fast, gpu (on the smoke's CPU: torchvision's CPU decoder) and
                exact; L/14 fast; last, B/16 fast at mmenc's default batch size (is it enough?).
  baseline_b16  the usual practice: a DataLoader (CPUs - 1 workers, PIL + the model's
                CLIPImageProcessor per file, pin_memory on CUDA), vectors copied to the CPU per
                batch; images/s from the end of the first batch to the end of the loop (and, as
                mmenc's is timed, over the whole loop: the first rate counts the batches the other
                workers made while the first one was made, so it overstates the steady rate).
  text_model    a BERT shaped as all-MiniLM-L6-v2 [smaller] as a sentence-transformers folder,
                random weights, a synthetic 30,522-entry WordPiece vocabulary; 200,000 [500] texts.
  texts_st      SentenceTransformer(...).encode(texts, batch_size=256 [32]) after a warm-up batch.
  texts_mmenc   `python -m mmenc_cli encode texts.jsonl`; texts/s excluding model load, as above.

Every heavy stage is its own process (killed at the hard time limit; the forward-only, DataLoader
and sentence-transformers ones are `gpu_children.py`), so a CUDA fault in one cannot poison the
others; logs go to OUTDIR/logs. Goals are printed, never asserted.
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

#: seconds since gpu.sh started (MMENC_GPU_BENCH_T0) past which no stage starts / children die
GUARD_S, HARD_S = 210.0, 232.0


@dataclass(frozen=True)
class Sizes:
    mode: str
    device: str
    dtype: str
    images: int
    texts: int
    batch: int
    text_batch: int
    clip: dict[str, str]  # role -> common.CLIP_SHAPES key
    text_shape: dict[str, Any] = field(default_factory=lambda: dict(common.MINILM_SHAPE))
    jpeg_slice: int = 250
    limit_seconds: float = 2.0
    warmup: int = 3
    guard_s: float = GUARD_S
    hard_s: float = HARD_S


FULL = Sizes("full", "cuda", "bfloat16", 10_000, 200_000, 256, 256, {"b16": "b16", "l14": "l14"})
SMOKE = Sizes("smoke", "cpu", "float32", 48, 500, 8, 32, {"b16": "tiny", "l14": "tiny"},
              text_shape={**common.MINILM_SHAPE, "hidden_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "intermediate_size": 128},
              jpeg_slice=16, limit_seconds=0.3, warmup=1, guard_s=600.0, hard_s=900.0)
GOALS = [("B/16 end to end >= 5,000 images/s", "b16_rate", 5000.0),
         ("B/16 mmenc fast >= 2.5x the DataLoader baseline", "b16_vs_baseline", 2.5),
         ("L/14 mmenc fast >= 90% of its forward-only limit", "l14_share", 0.90),
         ("MiniLM texts >= 1.5x sentence-transformers", "texts_ratio", 1.5)]


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

    def stage(self, name: str, fn: Callable[[], dict[str, Any]], needs: tuple[str, ...] = ()) -> None:
        missing = [n for n in needs if self.stages.get(n, {}).get("status") != "ok"]
        start = time.perf_counter()
        if missing:
            entry: dict[str, Any] = {"status": "skipped", "reason": f"needs {', '.join(missing)}"}
        elif self.elapsed() > self.s.guard_s:
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
        print(f"[{entry['at_s']:6.1f} s] {name:16s} {describe(name, entry)}", flush=True)

    def save(self) -> None:
        doc = {"mode": self.s.mode, "sizes": asdict(self.s), "elapsed_s": round(self.elapsed(), 1),
               "data": str(self.data), "stages": self.stages, "summary": summary(self.stages)}
        tmp = self.out / "gpu_bench.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.out / "gpu_bench.json")

    def proc(self, name: str, cmd: list[str]) -> str:
        """`cmd`'s stdout (stderr in logs/NAME.log), killed at the hard time limit."""
        logs = self.out / "logs"
        return common.run_logged(cmd, logs / f"{name}.out", logs / f"{name}.log", env=self.env,
                                 timeout=max(5.0, self.s.hard_s - self.elapsed()))

    def child(self, name: str, kind: str, model: Path, manifest: Path, batch: int) -> dict[str, Any]:
        cmd = [sys.executable, str(Path(__file__).with_name("gpu_children.py")), kind, "--model", str(model),
               "--manifest", str(manifest),
               "--device", self.s.device, "--dtype", self.s.dtype, "--batch-size", str(batch),
               "--seconds", str(self.s.limit_seconds), "--warmup", str(self.s.warmup)]
        return common.last_json(self.proc(name, cmd), "BENCH-RESULT ")

    def mmenc(self, name: str, manifest: Path, model: Path, batch: int | None, extra: list[str], expected: int,
              unit: str) -> dict[str, Any]:
        out = self.out / "runs" / name
        shutil.rmtree(out, ignore_errors=True)
        args = [str(manifest), "--model", str(model), "--out", str(out), "--json", "--progress", "none",
                "--device", self.s.device, "--dtype", self.s.dtype,
                *(["--batch-size", str(batch)] if batch else []), *extra]
        wall = time.perf_counter()
        result = common.last_json(self.proc(name, [sys.executable, "-m", "mmenc_cli", "encode", *args]), "")
        wall = time.perf_counter() - wall
        return {**mmenc_numbers(result, expected, unit), "wall_s": round(wall, 2), "args": args}


def mmenc_numbers(r: dict[str, Any], expected: int, unit: str) -> dict[str, Any]:
    """Rate, model-busy share and peak memory of one `mmenc encode --json` result."""
    c = r["counters"]
    seconds = c.get("seconds", {})
    if r.get("state") != "done" or c["encoded"] != expected:
        raise RuntimeError(f"mmenc encoded {c['encoded']} of {expected} (state {r.get('state')}, "
                           f"failed {c.get('failed')}, exit code {r.get('exit_code')})")
    load = float(seconds.get("load") or 0.0)
    loop = float(r["elapsed"]) - load
    device = seconds.get("forward_device")
    return {"encoded": c["encoded"], f"{unit}_per_s": c["encoded"] / loop, "elapsed_s": r["elapsed"],
            "load_s": round(load, 3), "loop_s": round(loop, 3),
            "model_busy": device / loop if device is not None else None, "forward_device_s": device,
            "peak_gpu_bytes": (r.get("forward") or {}).get("peak_memory_bytes"), "mmenc_seconds": seconds}


# ------------------------------------------------------------------------------------ stages


def facts(b: Bench) -> dict[str, Any]:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

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
            "dev_shm_free_bytes": shm.f_bavail * shm.f_frsize if shm else None,
            "device": b.s.device, "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "versions": vers, "mmenc_cli": str(Path(mmenc_cli.__file__).parent),
            "tokenizers_parallelism": b.env.get("TOKENIZERS_PARALLELISM", "unset (library default)")}


def jpegs(b: Bench) -> dict[str, Any]:
    n = b.s.images
    paths = common.make_jpegs_parallel(b.data / "jpegs-640x480-q90", n, (640, 480), 90, per_slice=b.s.jpeg_slice)
    rows = ({"id": f"img{i:06d}", "image": str(p.resolve())} for i, p in enumerate(paths))
    b.paths["images"] = common.write_manifest(b.out / "manifests" / f"images-{n}.jsonl", rows)
    mib = sum(p.stat().st_size for p in paths) / 2**20
    return {"count": len(paths), "size": "640x480", "quality": 90, "mean_kib": round(mib * 1024 / len(paths), 1),
            "manifest": str(b.paths["images"])}


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


def baseline(b: Bench) -> dict[str, Any]:
    r = b.child("baseline_b16", "baseline", b.paths["b16"], b.paths["images"], b.s.batch)
    if r["encoded"] != b.s.images:
        raise RuntimeError(f"baseline encoded {r['encoded']} of {b.s.images}")
    return r


def mmenc_images(b: Bench, role: str, decode: str, batch: int | None = -1, name: str = "") -> dict[str, Any]:
    """mmenc on the JPEGs; `batch` None: mmenc's default batch size (-1: the benchmark's)."""
    return b.mmenc(name or f"mmenc_{role}_{decode}", b.paths["images"], b.paths[role],
                   b.s.batch if batch == -1 else batch, ["--decode", decode], b.s.images, "images")


def texts_st(b: Bench) -> dict[str, Any]:
    r = b.child("texts_st", "st", b.paths["minilm"], b.paths["texts"], b.s.text_batch)
    if r["encoded"] != b.s.texts:
        raise RuntimeError(f"sentence-transformers encoded {r['encoded']} of {b.s.texts}")
    return r


def texts_mmenc(b: Bench) -> dict[str, Any]:
    return b.mmenc("texts_mmenc", b.paths["texts"], b.paths["minilm"], b.s.text_batch, [], b.s.texts, "texts")


def run_all(b: Bench) -> None:
    """The stages, in order of importance: the time guard drops the last ones first."""
    img = ("facts", "jpegs", "models")
    b.stage("facts", lambda: facts(b))
    b.stage("jpegs", lambda: jpegs(b), ("facts",))
    b.stage("models", lambda: models(b), ("facts",))
    b.stage("limit_b16", lambda: limit(b, "b16"), ("facts", "models"))
    b.stage("limit_l14", lambda: limit(b, "l14"), ("facts", "models"))
    b.stage("mmenc_b16_fast", lambda: mmenc_images(b, "b16", "fast"), img)
    b.stage("mmenc_b16_gpu", lambda: mmenc_images(b, "b16", "gpu"), img)
    b.stage("baseline_b16", lambda: baseline(b), img)
    b.stage("mmenc_l14_fast", lambda: mmenc_images(b, "l14", "fast"), img)
    b.stage("text_model", lambda: text_model(b), ("facts",))
    b.stage("texts_st", lambda: texts_st(b), ("text_model",))
    b.stage("texts_mmenc", lambda: texts_mmenc(b), ("text_model",))
    b.stage("mmenc_b16_exact", lambda: mmenc_images(b, "b16", "exact"), img)
    # mmenc's default batch size against the benchmark's: the evidence for a CUDA default
    b.stage("mmenc_b16_default_batch", lambda: mmenc_images(b, "b16", "fast", None, "mmenc_b16_default_batch"), img)


# ----------------------------------------------------------------------------------- report


def summary(st: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ratios the goals are about, each goal met or not (None: a number is missing)."""
    def val(stage: str, key: str) -> float | None:
        return st[stage].get(key) if st.get(stage, {}).get("status") == "ok" else None

    def div(a: float | None, c: float | None) -> float | None:
        return a / c if a is not None and c else None

    b16 = {d: val(f"mmenc_b16_{d}", "images_per_s") for d in ("fast", "gpu")}
    best = max((d for d in b16 if b16[d] is not None), key=lambda d: b16[d], default=None)
    nums = {"b16_rate": b16[best] if best else None, "b16_rate_decode": best,
            "b16_vs_baseline": div(b16["fast"], val("baseline_b16", "images_per_s")),
            "b16_vs_baseline_whole_loop": div(b16["fast"], val("baseline_b16", "images_per_s_whole_loop")),
            "b16_share": div(b16["fast"], val("limit_b16", "images_per_s")),
            "l14_share": div(val("mmenc_l14_fast", "images_per_s"), val("limit_l14", "images_per_s")),
            "texts_ratio": div(val("texts_mmenc", "texts_per_s"), val("texts_st", "texts_per_s")),
            "b16_default_batch_share": div(val("mmenc_b16_default_batch", "images_per_s"), b16["fast"])}
    goals = [{"goal": text, "value": nums[key], "target": target,
              "met": None if nums[key] is None else nums[key] >= target} for text, key, target in GOALS]
    return {"numbers": nums, "goals": goals, "failed": [k for k, v in st.items() if v["status"] == "failed"],
            "skipped": [k for k, v in st.items() if v["status"] == "skipped"]}


def describe(name: str, e: dict[str, Any]) -> str:
    """One readable line for a stage's entry."""
    if e["status"] == "failed":
        return f"FAILED {e['error']['type']}: {(e['error']['message'].splitlines() or [''])[0][:160]}"
    if e["status"] != "ok":
        return f"{e['status'].upper()}: {e.get('reason', '')}"
    unit = "images" if "images_per_s" in e else "texts" if "texts_per_s" in e else None
    if unit:
        busy = f", model busy {e['model_busy']:.0%}" if e.get("model_busy") is not None else ""
        peak = f", peak GPU {e['peak_gpu_bytes'] / 2**30:.1f} GiB" if e.get("peak_gpu_bytes") else ""
        done = f", {e['encoded']} encoded" if "encoded" in e else ""
        return f"{e[unit + '_per_s']:10,.1f} {unit}/s{busy}{peak}{done} ({e['seconds']:.1f} s)"
    if name == "facts":
        v = e["versions"]
        return (f"{e['gpu'] or 'no GPU'}, {e['cpus']} CPUs, torch {v['torch']}, transformers {v['transformers']}, "
                f"torchvision {v['torchvision']}")
    if name == "jpegs":
        return f"{e['count']} JPEGs {e['size']} q{e['quality']}, {e['mean_kib']} KiB each ({e['seconds']:.1f} s)"
    return f"ok ({e['seconds']:.1f} s)"


def report(b: Bench) -> int:
    """The table, the ratios and the goals; the exit status (1: a stage failed)."""
    s, pct = summary(b.stages), (lambda v: "n/a" if v is None else f"{v:.0%}")
    n, x = s["numbers"], (lambda v: "n/a" if v is None else f"{v:.2f}x")
    print(f"\nmmenc GPU benchmark ({b.s.mode}: {b.s.device}, {b.s.dtype}, batch {b.s.batch}), "
          f"{b.elapsed():.0f} s since start; JSON: {b.out / 'gpu_bench.json'}")
    for name, entry in b.stages.items():
        print(f"  {name:16s} {describe(name, entry)}")
    print(f"  mmenc B/16 fast / DataLoader baseline: {x(n['b16_vs_baseline'])} (baseline timed after its first "
          f"batch; {x(n['b16_vs_baseline_whole_loop'])} against its whole loop); of its forward-only limit: B/16 fast "
          f"{pct(n['b16_share'])}, L/14 fast {pct(n['l14_share'])}; texts mmenc / sentence-transformers: "
          f"{x(n['texts_ratio'])}; mmenc's default batch size / batch {b.s.batch}: "
          f"{pct(n['b16_default_batch_share'])}")
    print("goals, informational" + (" (smoke sizes: not meaningful):" if b.s.mode == "smoke" else ":"))
    for g in s["goals"]:
        value = "n/a" if g["value"] is None else f"{g['value']:,.2f}"
        print(f"  {g['goal']:50s} {value:>10s}  {'n/a' if g['met'] is None else 'met' if g['met'] else 'NOT met'}")
    for what in ("skipped", "failed"):
        if s[what]:
            print(f"{what.upper()}: {', '.join(s[what])} (reasons in the JSON; logs in {b.out / 'logs'})")
    return 1 if s["failed"] else 0


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
    sys.exit(report(bench))


if __name__ == "__main__":
    main()
