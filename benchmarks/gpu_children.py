"""The child processes of `gpu_bench.py`: the forward-only limit, the DataLoader baseline and
sentence-transformers' encode, each printing one `BENCH-RESULT {json}` line.

    python benchmarks/gpu_children.py limit|baseline|st --model DIR --manifest FILE --device D
        --dtype T --batch-size N --seconds S --warmup W
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def child_limit(a: argparse.Namespace) -> dict[str, Any]:
    """Forward only: `get_image_features` on random pixels already on the device."""
    import torch
    from transformers import CLIPModel

    dtype, cuda = getattr(torch, a.dtype), a.device.startswith("cuda")
    model = CLIPModel.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    side = model.config.vision_config.image_size
    pixels = torch.randn(a.batch_size, 3, side, side, device=a.device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        for _ in range(a.warmup):
            features(model, pixels)
        sync()
        t = time.perf_counter()
        shape = tuple(features(model, pixels).shape)
        features(model, pixels)
        sync()
        iters = max(3, min(1000, int(2 * a.seconds / (time.perf_counter() - t))))
        t = time.perf_counter()
        for _ in range(iters):
            features(model, pixels)
        sync()
        timed = time.perf_counter() - t
    if shape != (a.batch_size, model.config.projection_dim):
        raise RuntimeError(f"image features of shape {shape} for a batch of {a.batch_size}")
    return {"images_per_s": iters * a.batch_size / timed, "iterations": iters, "timed_s": round(timed, 3),
            "batch": a.batch_size, "dtype": str(next(model.parameters()).dtype),
            "attention": getattr(model.config, "_attn_implementation", None),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def features(model: Any, pixels: Any) -> Any:
    out = model.get_image_features(pixel_values=pixels)
    return out if hasattr(out, "shape") else out.pooler_output  # a tensor, or an output object


class FileDataset:
    """The usual practice: PIL opens each file, the model's own processor makes its pixels."""

    def __init__(self, paths: list[str], processor: Any) -> None:
        self.paths, self.processor = paths, processor

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        from PIL import Image

        with Image.open(self.paths[i]) as im:
            image = im.convert("RGB")
        return self.processor(images=image, return_tensors="pt")["pixel_values"][0]


def child_baseline(a: argparse.Namespace) -> dict[str, Any]:
    """A DataLoader (CPUs - 1 workers, pinned on CUDA) into the model; vectors to the CPU per batch."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import CLIPImageProcessor, CLIPModel

    dtype, cuda = getattr(torch, a.dtype), a.device.startswith("cuda")
    model = CLIPModel.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    paths = [json.loads(line)["image"] for line in open(a.manifest, encoding="utf-8")]
    workers = max(1, len(os.sched_getaffinity(0)) - 1)
    loader = DataLoader(FileDataset(paths, CLIPImageProcessor.from_pretrained(a.model)), batch_size=a.batch_size,
                        num_workers=workers, pin_memory=cuda)
    done, after_first, vectors = 0, 0.0, []
    with torch.inference_mode():
        side = model.config.vision_config.image_size  # a warm-up batch, as mmenc's load-time probe
        features(model, torch.randn(a.batch_size, 3, side, side, device=a.device, dtype=dtype)).float().cpu()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in loader:
            out = features(model, batch.to(a.device, non_blocking=True).to(dtype))
            vectors.append(out.float().cpu())  # waits for the GPU
            done += len(batch)
            if not after_first:
                first, after_first = done, time.perf_counter()
    end = time.perf_counter()
    return {"images_per_s": (done - first) / (end - after_first), "encoded": done, "workers": workers,
            "timed": "images_per_s: from the end of the first batch to the end of the loop (no worker start-up; "
                     "counts the batches the other workers made meanwhile, so it overstates the steady rate); "
                     "images_per_s_whole_loop: from the first request to the end, as mmenc's elapsed - load",
            "first_batch_s": round(after_first - t0, 3), "loop_s": round(end - t0, 3),
            "images_per_s_whole_loop": done / (end - t0), "pin_memory": cuda,
            "processor": type(loader.dataset.processor).__name__, "dtype": str(next(model.parameters()).dtype),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def child_st(a: argparse.Namespace) -> dict[str, Any]:
    """sentence-transformers' own encode, after one warm-up batch (mmenc probes at load too)."""
    import torch
    from sentence_transformers import SentenceTransformer

    texts = [json.loads(line)["text"] for line in open(a.manifest, encoding="utf-8")]
    t0 = time.perf_counter()
    model = SentenceTransformer(a.model, device=a.device, model_kwargs={"dtype": getattr(torch, a.dtype)})
    dtype = next(model.parameters()).dtype
    if dtype != getattr(torch, a.dtype):
        raise RuntimeError(f"sentence-transformers loaded the model in {dtype}, not {a.dtype}")
    model.encode(texts[: a.batch_size], batch_size=a.batch_size)
    load = time.perf_counter() - t0
    t = time.perf_counter()
    vectors = model.encode(texts, batch_size=a.batch_size)
    timed = time.perf_counter() - t
    return {"texts_per_s": len(vectors) / timed, "encoded": len(vectors), "encode_s": round(timed, 3),
            "load_s": round(load, 3), "dim": int(vectors.shape[1]), "dtype": str(dtype)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["limit", "baseline", "st"])
    for name, kind in (("--model", str), ("--manifest", str), ("--device", str), ("--dtype", str),
                       ("--batch-size", int), ("--seconds", float), ("--warmup", int)):
        ap.add_argument(name, type=kind, required=True)
    args = ap.parse_args()
    fn = {"limit": child_limit, "baseline": child_baseline, "st": child_st}[args.kind]
    print("BENCH-RESULT " + json.dumps(fn(args)), flush=True)


if __name__ == "__main__":
    main()
