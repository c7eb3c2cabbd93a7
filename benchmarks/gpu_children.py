"""The child processes of `gpu_bench.py`, each printing one `BENCH-RESULT {json}` line: the
forward-only limit, the DataLoader baseline, sentence-transformers' encode, and mmenc itself
(`run_encode`, its public API, with a progress hook that times the steady state).

    python benchmarks/gpu_children.py limit|baseline|st|mmenc --model DIR --manifest FILE --device D
        --dtype T --batch-size N --seconds S --warmup W [--out DIR] [--decode MODE] [--vectors FILE]
        [--min-waves K] [--max-workers N]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

#: bytes of shared memory a DataLoader batch takes per item (float32 3x224x224 pixels), and the
#: batches each worker keeps there (torch's default prefetch_factor)
PIXEL_BYTES, PREFETCH = 3 * 224 * 224 * 4, 2


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


def shm_check(workers: int, batch: int, path: str = "/dev/shm") -> dict[str, Any]:
    """DataLoader workers hand each batch over in shared memory: what `path` has free against what
    the workers keep there at once; RuntimeError before any worker starts when it is too small
    (a worker would otherwise die of SIGBUS halfway)."""
    need = workers * PREFETCH * batch * PIXEL_BYTES
    st = os.statvfs(path) if os.path.isdir(path) else None
    free = st.f_bavail * st.f_frsize if st else None
    if free is None or free < 1.25 * need:
        raise RuntimeError(f"{path} has {free} bytes free; the DataLoader's {workers} workers need about {need} "
                           f"(+25%) for {PREFETCH} batches of {batch} each: give the container more shared memory "
                           "(e.g. docker --shm-size) and run again")
    return {"dev_shm_free_bytes": free, "dev_shm_needed_bytes": need}


def child_baseline(a: argparse.Namespace) -> dict[str, Any]:
    """A DataLoader (workers: the usable CPUs less one, as mmenc's default) into the model; vectors
    to the CPU per batch. Timed from the end of the first wave (one batch from every worker) to
    the end, over at least `--min-waves` more; its vectors are saved with their ids."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader
    from transformers import CLIPImageProcessor, CLIPModel

    from mmenc_cli.cpus import usable_cpus

    dtype, cuda = getattr(torch, a.dtype), a.device.startswith("cuda")
    rows = [json.loads(line) for line in open(a.manifest, encoding="utf-8")]
    cpus = usable_cpus()
    workers = max(1, min(cpus - 1, a.max_workers or cpus))
    wave = workers * a.batch_size
    waves = len(rows) // wave - 1
    if waves < a.min_waves:
        raise RuntimeError(f"{len(rows)} rows make {waves} waves after the first of {wave} ({workers} workers x "
                           f"batch {a.batch_size}); at least {a.min_waves} are needed")
    shm = shm_check(workers, a.batch_size)
    model = CLIPModel.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    loader = DataLoader(FileDataset([r["image"] for r in rows], CLIPImageProcessor.from_pretrained(a.model)),
                        batch_size=a.batch_size, num_workers=workers, pin_memory=cuda)
    with torch.inference_mode():
        side = model.config.vision_config.image_size  # a warm-up batch, as mmenc's load-time probe
        features(model, torch.randn(a.batch_size, 3, side, side, device=a.device, dtype=dtype)).float().cpu()
    done, first, t_wave, vectors = 0, 0, 0.0, []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in loader:
            out = features(model, batch.to(a.device, non_blocking=True).to(dtype))
            vectors.append(out.float().cpu())  # waits for the GPU
            done += len(batch)
            if not t_wave and done >= wave:
                first, t_wave = done, time.perf_counter()
    end = time.perf_counter()
    np.savez(a.vectors, ids=np.array([r["id"] for r in rows]), vectors=torch.cat(vectors).numpy())
    return {"images_per_s": (done - first) / (end - t_wave), "encoded": done, "workers": workers, "cpus": cpus,
            "waves_timed": (done - first) / wave, "timed": "images_per_s: from the end of the first wave (a batch "
            "from every worker) to the end of the loop; images_per_s_whole_loop: from the first request",
            "first_wave_s": round(t_wave - t0, 3), "loop_s": round(end - t0, 3),
            "images_per_s_whole_loop": done / (end - t0), "pin_memory": cuda, **shm,
            "processor": type(loader.dataset.processor).__name__, "dtype": str(next(model.parameters()).dtype),
            "vectors": a.vectors, "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None}


def child_st(a: argparse.Namespace) -> dict[str, Any]:
    """sentence-transformers' own encode, after one warm-up batch (mmenc warms up at load too); the
    first `--keep` vectors are saved with their ids."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    rows = [json.loads(line) for line in open(a.manifest, encoding="utf-8")]
    texts = [r["text"] for r in rows]
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
    np.savez(a.vectors, ids=np.array([r["id"] for r in rows[: a.keep]]), vectors=vectors[: a.keep])
    return {"texts_per_s": len(vectors) / timed, "encoded": len(vectors), "encode_s": round(timed, 3),
            "load_s": round(load, 3), "dim": int(vectors.shape[1]), "dtype": str(dtype), "vectors": a.vectors}


def child_mmenc(a: argparse.Namespace) -> dict[str, Any]:
    """mmenc through its public API (`run_encode` on a `RunConfig`, every other option at its
    default, as the CLI would make it), with a progress hook at each batch group it accounts for:
    the steady rate is the items of the groups after the first over the time from the first
    group's vectors to the last's."""
    from mmenc_cli import BatchConfig, MediaConfig, ModelConfig, RunConfig, WriterConfig, run_encode

    marks: list[tuple[float, int]] = []
    cfg = RunConfig(manifests=(a.manifest,), model=ModelConfig(model=a.model, device=a.device, dtype=a.dtype),
                    writer=WriterConfig(out=a.out), batch=BatchConfig(batch_size=a.batch_size or None),
                    media=MediaConfig(decode=a.decode), overwrite=True)
    result = run_encode(cfg, progress=lambda c: marks.append((time.perf_counter(), c.encoded_now)))
    out = result.to_dict()
    (t1, n1), (t2, n2) = (marks[0], marks[-1]) if marks else ((0.0, 0), (0.0, 0))
    out["steady"] = {"items": n2 - n1, "seconds": round(t2 - t1, 4), "groups": len(marks),
                     "per_s": (n2 - n1) / (t2 - t1) if t2 > t1 else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["limit", "baseline", "st", "mmenc"])
    for name, kind in (("--model", str), ("--manifest", str), ("--device", str), ("--dtype", str),
                       ("--batch-size", int), ("--seconds", float), ("--warmup", int)):
        ap.add_argument(name, type=kind, required=True)
    ap.add_argument("--out", help="mmenc: the output folder")
    ap.add_argument("--decode", help="mmenc: --decode (default: mmenc's)")
    ap.add_argument("--vectors", help="baseline, st: where to save the vectors (.npz, ids and vectors)")
    ap.add_argument("--keep", type=int, default=4096, help="st: vectors saved")
    ap.add_argument("--min-waves", type=int, default=8, help="baseline: waves timed after the first, at least")
    ap.add_argument("--max-workers", type=int, default=0, help="baseline: at most this many workers (0: no cap)")
    args = ap.parse_args()
    fn = {"limit": child_limit, "baseline": child_baseline, "st": child_st, "mmenc": child_mmenc}[args.kind]
    print("BENCH-RESULT " + json.dumps(fn(args)), flush=True)


if __name__ == "__main__":
    main()
