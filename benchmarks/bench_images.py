"""Images/s: a naive transformers loop, a good batched single-process loop, and mmenc.

    python benchmarks/bench_images.py [--device cpu|cuda] [--images N] [--model-size b32|l14]
                                      [--batch-size 32] [--workers W] [--runs 3] [--compile]

Input: generated photo-like 640x480 JPEGs at quality 90 (512 distinct files, cycled by the
manifest when N is larger). Model: CLIP with a ViT-B/32- (or ViT-L/14-) shaped image tower and
random weights, CLIP's own image processor (bicubic shortest-edge 224, center crop 224).

Variants, each a whole Python process started by this script and measured the same way:
  (a) naive:   transformers, one image at a time: PIL open -> processor -> get_image_features.
  (b) batched: one process, no workers: batches of --batch-size through the processor and the
               model under inference_mode (on CUDA: bfloat16, pinned memory, non-blocking copies).
  (c) mmenc:   `python -m mmenc_cli encode manifest.jsonl --modality image ...` (decode workers,
               uint8 pixels across processes, background shard writer); default --workers.
  (c0) mmenc with PyTorch's own CPU forward (`--cpu-forward plain`): the same forward as (b),
               one batch at a time on all threads; (c0)/(b) is what the pipeline gains without
               mmenc's CPU forward, (c)/(c0) what its two streams and oneDNN's linears add where
               the run's timed probes choose them (each mmenc run's choice is printed under the
               medians). CPU only.

For each: end-to-end wall time of the process (interpreter start, imports, model load, all
images, writing the embeddings) and throughput excluding start-up and model load (the loop from
the first image to the last embedding written; for mmenc its own run time minus the model load it
records in its task metadata). Forward busy share = seconds the forward pass was busy / loop seconds: for (a)/(b) timed
around the forward (CUDA events on CUDA); for mmenc its `encode` stage seconds from the run's
task metadata; on CUDA the GPU time of its forward passes, which mmenc records with CUDA events
(`seconds.forward_device` in the task metadata). Median of --runs
runs, the variants interleaved so background load hits them alike; ratios are of medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

UNIQUE_IMAGES = 512


# ------------------------------------------------------------------------------------ children


def _child(args: argparse.Namespace) -> None:
    """One baseline variant in its own process; prints BENCH-RESULT {...} on stderr."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, CLIPModel

    t_load = time.perf_counter()
    device = args.device
    dtype = torch.float32 if device == "cpu" else (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = CLIPModel.from_pretrained(args.model, dtype=dtype).to(device).eval()
    processor = AutoImageProcessor.from_pretrained(args.model)
    paths = [json.loads(line)["image"] for line in open(args.manifest, encoding="utf-8")]
    cuda = device.startswith("cuda")

    def features(pixel_values: "torch.Tensor") -> "torch.Tensor":
        out = model.get_image_features(pixel_values=pixel_values)
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    def to_device(t: "torch.Tensor") -> "torch.Tensor":
        return t.pin_memory().to(device, non_blocking=True) if cuda else t

    with torch.inference_mode():  # warm-up on one image, as mmenc's load-time probe does
        features(to_device(processor(images=[Image.new("RGB", (64, 48))], return_tensors="pt")["pixel_values"]).to(dtype))
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t_load

    forward_s = 0.0
    events: list[tuple[Any, Any]] = []
    outputs = []
    step = 1 if args.child == "naive" else args.batch_size
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(paths), step):
            images = [Image.open(p).convert("RGB") for p in paths[start:start + step]]
            pixels = to_device(processor(images=images, return_tensors="pt")["pixel_values"]).to(dtype)
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                vectors = features(pixels)
                end.record()
                events.append((begin, end))
            else:
                tf = time.perf_counter()
                vectors = features(pixels)
                forward_s += time.perf_counter() - tf
            outputs.append(vectors.float().cpu().numpy())
    if cuda:
        torch.cuda.synchronize()
        forward_s = sum(b.elapsed_time(e) for b, e in events) / 1000.0
    np.save(args.out, np.concatenate(outputs))
    loop_s = time.perf_counter() - t0
    print("BENCH-RESULT " + json.dumps({"n": len(paths), "load_s": load_s, "loop_s": loop_s,
                                        "forward_s": forward_s}), file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------- parent


def run_baseline(kind: str, args: argparse.Namespace, model: Path, manifest: Path, work: Path) -> dict[str, float]:
    cmd = [common.PYTHON, __file__, "--child", kind, "--model", str(model), "--manifest", str(manifest),
           "--device", args.device, "--batch-size", str(args.batch_size), "--out", str(work / f"{kind}.npy")]
    t = common.run_timed(cmd)
    common.check(t, f"variant {kind}")
    r = common.parse_kv(t)
    return {"wall": t.wall, "n": r["n"], "loop": r["loop_s"], "busy": r["forward_s"] / r["loop_s"], "others": t.others}


def run_mmenc(args: argparse.Namespace, model: Path, manifest: Path, work: Path,
              cpu_forward: str = "auto") -> dict[str, Any]:
    extra = ["--modality", "image", "--batch-size", str(args.batch_size), "--device", args.device,
             "--model", str(model), "--cpu-forward", cpu_forward]
    if args.workers is not None:
        extra += ["--workers", str(args.workers)]
    if args.compile:
        extra.append("--compile")
    r = common.run_mmenc([str(manifest), *extra], work / "mmenc-out")
    loop = r.elapsed - (r.load_seconds or 0.0)
    return {"wall": r.wall, "n": r.items, "loop": loop, "busy": r.busy_share, "seconds": r.seconds,
            "load": r.load_seconds, "elapsed": r.elapsed, "others": r.others, "cpu_path": r.cpu_path}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--images", type=int, default=None, help="default: 1024 on CPU, 8192 on CUDA")
    ap.add_argument("--naive-images", type=int, default=None,
                    help="images for (a), whose rate does not depend on the count (default: 256 on CPU, 2048 on CUDA)")
    ap.add_argument("--model-size", choices=sorted(common.CLIP_SHAPES), default="b32")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=None, help="mmenc --workers (default: mmenc's own)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default=None, help="default: a,b,c,c0 on CPU, a,b,c on CUDA; also c1")
    ap.add_argument("--compile", action="store_true", help="pass --compile to mmenc")
    ap.add_argument("--child", choices=["naive", "batched"], help=argparse.SUPPRESS)
    common.child_args(ap)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return

    cuda = args.device.startswith("cuda")
    n = args.images or (8192 if cuda else 1024)
    n_naive = args.naive_images or min(n, 2048 if cuda else 256)
    variants = [v.strip() for v in (args.variants or ("a,b,c" if cuda else "a,b,c,c0")).split(",") if v.strip()]
    print(common.machine(args.device), flush=True)
    model = common.make_clip(args.model_size)
    images = common.make_jpegs(common.CACHE / "jpegs-640x480", min(n, UNIQUE_IMAGES))
    work = common.CACHE / "work-images"
    work.mkdir(parents=True, exist_ok=True)

    def manifest(count: int) -> Path:
        rows = ({"id": f"img{i}", "image": str(images[i % len(images)])} for i in range(count))
        return common.write_manifest(work / f"manifest-{count}.jsonl", rows)

    manifests = {"a": manifest(n_naive), "b": manifest(n), "c": manifest(n), "c0": manifest(n)}
    print(f"model: CLIP {args.model_size.upper()}-shaped image tower, random weights ({model}); "
          f"{n} images 640x480 JPEG q90 ({len(images)} distinct), batch size {args.batch_size}; "
          f"(a) on {n_naive} images", flush=True)
    names = {"a": "(a) naive, one image at a time", "b": "(b) batched, single process", "c": "(c) mmenc, whole process",
             "c0": "(c0) mmenc, PyTorch's CPU forward"}
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}

    def one(v: str) -> dict[str, Any]:
        if v == "c":
            return run_mmenc(args, model, manifests[v], work)
        if v == "c0":
            return run_mmenc(args, model, manifests[v], work, cpu_forward="plain")
        return run_baseline("naive" if v == "a" else "batched", args, model, manifests[v], work)

    for run in range(args.runs):
        for v in variants:
            r, note = common.quiet_run(lambda: one(v), lambda r: r["others"])
            results[v].append(r)
            print(f"  run {run + 1} {names[v]}: {r['n'] / r['loop']:.2f} images/s excl. load, "
                  f"{r['n'] / r['wall']:.2f} end to end ({r['wall']:.1f} s), forward busy {r['busy']:.0%}; {note}",
                  flush=True)

    print("\nmedian of %d runs:" % args.runs)
    med: dict[str, dict[str, float]] = {}
    for v in variants:
        rs = results[v]
        med[v] = {"rate": common.median([r["n"] / r["loop"] for r in rs]),
                  "e2e": common.median([r["n"] / r["wall"] for r in rs]),
                  "wall": common.median([r["wall"] for r in rs]),
                  "busy": common.median([r["busy"] for r in rs])}
        print(f"  {names[v]:36s} {med[v]['rate']:8.2f} images/s excl. load  {med[v]['e2e']:8.2f} images/s end to end "
              f"(wall {med[v]['wall']:.1f} s)  forward busy {med[v]['busy']:.0%}")
    for v in ("c", "c0"):
        if v not in med:
            continue
        c = sorted(results[v], key=lambda r: r["n"] / r["loop"])[len(results[v]) // 2]
        print(f"  {v} seconds per stage (median run): model load {c['load'] or 0:.1f}, read {c['seconds']['read']:.2f}, "
              f"decode {c['seconds']['decode']:.2f} (summed over workers), encode {c['seconds']['encode']:.2f}, "
              f"write {c['seconds']['write']:.2f}, run {c['elapsed']:.2f}; forward busy {c['busy']:.0%} of the loop")
        for r in results[v]:
            if r["cpu_path"]:
                print(f"    CPU linears: {r['cpu_path']}")
    print("ratios (medians, excl. load / end to end):")
    for x, y in (("c", "b"), ("c0", "b"), ("c", "c0"), ("c", "a"), ("b", "a")):
        if x in med and y in med:
            print(f"  {x}/{y}: {common.ratio(med[x]['rate'], med[y]['rate'])} / {common.ratio(med[x]['e2e'], med[y]['e2e'])}")
    if "c" in med and "b" in med:
        ok = med["c"]["rate"] >= 1.05 * med["b"]["rate"]
        print(f"target (c) >= 1.05x (b) excl. load: {'met' if ok else 'NOT met'}")
    if "c0" in med and "b" in med:
        ok = med["c0"]["rate"] >= 1.05 * med["b"]["rate"]
        print(f"same kernels as (b): (c0) >= 1.05x (b) excl. load: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
