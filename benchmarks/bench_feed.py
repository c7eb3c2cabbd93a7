"""The image feed: how fast mmenc's real pipeline turns JPEG files into model input, with a model
that costs nothing, against a one-core loop doing the same decode + resize + crop.

    python benchmarks/bench_feed.py [--sizes 640x480,1280x960,1920x1080] [--images 256]
                                    [--workers W] [--photos DIR] [--fidelity-only]

Input: generated photo-like JPEGs (quality 90; `common.make_jpegs`, cached). Preprocessing:
CLIP's (bicubic shortest edge 224, center crop 224), the uint8 worker path. For each size:

  loop exact   one core, a plain loop: PIL open + full decode, resize, crop (the baseline)
  loop fast    the same with the JPEG decoded at a reduced DCT scale (`Image.draft`)
  mmenc fast   `run_encode` in this process (start-up excluded: the encoder is `NullEncoder`, which
  mmenc exact  returns zeros behind the real `Encoder` interface), default `--decode fast` / exact,
               default `--workers` (CPUs - 1); the real reader, decode pool, batching, stage and
               writer run. Whole run wall time, pool start included.

Printed: images/s of each, mmenc's per decode worker, the ratios to `loop exact`, and the main
process's CPU time per item (everything the encode process does besides decoding: transport
from the workers, batching, accounting, writing; `time.process_time` over the run). Targets
(2-core machine, 1280x960): mmenc fast >= 2.5x loop exact, mmenc exact >= 0.85x, main-process
cost <= 0.1 ms per item.

Then the fast path's fidelity: PSNR of its model-input pixels against exact decoding, min and
median, on the generated images of each size and 4000x3000, and on real photos: scikit-learn's two
(640x427) and any JPEG or PNG in `--photos DIR`, each measured at the ratios of 640x480, 1920x1080
and 4000x3000 to a 224 input (the input edge scaled to the photo: what decides the reduced decode
and the resize is the ratio). Target: min >= 30 dB, median >= 40 dB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's mmenc_cli, not an installed one
import common  # noqa: E402


def _clip(edge: int = 224) -> Any:
    from mmenc_cli.encoders.preprocess import PixelPreprocessor

    return PixelPreprocessor(None, edge, (edge, edge), 3)


class NullEncoder:
    """Built on first use (imports torch): zeros behind the real `Encoder` interface."""

    @staticmethod
    def make(cfg: Any, device: str | None = None) -> Any:
        import torch

        from mmenc_cli.encoders.base import EncodeOutput, Encoder

        class _Null(Encoder):
            modalities = frozenset({"image"})
            dim, default_normalize = 8, False
            info = {"family": "null", "revision": "null"}

            def image_preprocessor(self) -> Any:
                return _clip()

            def encode(self, modality: str, payloads: Sequence[Any]) -> Any:
                return EncodeOutput(torch.zeros((len(payloads), 8)))

        return _Null()


def loop_rate(paths: list[Path], fast: bool) -> float:
    """Images/s of a one-core loop: open, decode (reduced when `fast`), resize, crop."""
    from mmenc_cli.config import MediaConfig
    from mmenc_cli.media.decode import decode_image

    pre, media = _clip(), MediaConfig()
    pre = pre.for_fast_decode() if fast else pre
    t0 = time.perf_counter()
    for path in paths:
        pre(decode_image(path.read_bytes(), media, None, pre.draft_size if fast else None))
    return len(paths) / (time.perf_counter() - t0)


def mmenc_rate(paths: list[Path], mode: str, workers: int | None) -> tuple[float, float, int]:
    """(images/s, main-process CPU ms per item, workers) of `run_encode` over `paths`."""
    from mmenc_cli.config import BatchConfig, MediaConfig, ModelConfig, RunConfig, WriterConfig
    from mmenc_cli.run.pipeline import run_encode

    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "m.jsonl"
        manifest.write_text("".join(json.dumps({"id": f"i{i}", "image": str(p)}) + "\n" for i, p in enumerate(paths)))
        batch = BatchConfig(batch_size=32, workers=workers)
        cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model="null", device="cpu"),
                        writer=WriterConfig(out=str(Path(tmp) / "out")), batch=batch, media=MediaConfig(decode=mode))
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = run_encode(cfg, encoder_factory=NullEncoder.make)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    assert res.counters.encoded == len(paths), res.counters
    return len(paths) / wall, 1000 * cpu / len(paths), batch.workers_per_device()


def psnr_stats(datas: list[bytes], edge: int | list[int]) -> tuple[float, float]:
    """(min, median) PSNR of the fast path's model input against exact decoding's (an input edge
    for all images, or one each)."""
    import numpy as np

    from mmenc_cli.config import MediaConfig
    from mmenc_cli.media.decode import decode_image

    media, values = MediaConfig(), []
    for data, side in zip(datas, edge if isinstance(edge, list) else [edge] * len(datas)):
        pre = _clip(side)
        a = pre(decode_image(data, media, None)).pixels.astype(np.float64)
        b = pre.for_fast_decode()(decode_image(data, media, None, pre.draft_size)).pixels.astype(np.float64)
        mse = float(np.mean((a - b) ** 2))
        values.append(float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse))
    return min(values), float(np.median(values))


def feed(sizes: list[tuple[int, int]], n: int, workers: int | None) -> None:
    cache = Path(os.environ.get("MMENC_BENCH_CACHE", "/tmp/mmenc-bench-cache")) / "feed"
    print(f"{'size':>10} {'loop exact':>11} {'loop fast':>10} {'mmenc fast':>11} {'mmenc exact':>12} "
          f"{'per worker':>11} {'fast/loop':>10} {'exact/loop':>11} {'main ms/item':>13}")
    for w, h in sizes:
        paths = common.make_jpegs(cache, n, (w, h))
        loop_rate(paths[:8], False)  # page cache and Pillow warm
        mmenc_rate(paths[:16], "fast", workers)  # warms imports and the forkserver
        exact_loop, fast_loop = loop_rate(paths, False), loop_rate(paths, True)
        _, half_cost, _ = mmenc_rate(paths[:n // 2], "fast", workers)
        fast, fast_cost, k = mmenc_rate(paths, "fast", workers)
        exact, _, _ = mmenc_rate(paths, "exact", workers)
        per_item = (fast_cost * n - half_cost * (n // 2)) / (n - n // 2)  # the run's fixed cost taken out
        print(f"{w}x{h:<5} {exact_loop:11.1f} {fast_loop:10.1f} {fast:11.1f} {exact:12.1f} "
              f"{fast / k:6.1f} ({k}) {fast / exact_loop:9.2f}x {exact / exact_loop:10.2f}x {per_item:13.3f}")
    print("images/s; per worker = mmenc fast / workers (their count); main ms/item = the encode process's "
          "CPU time per image: (run of N - run of N/2) / (N/2), the fixed cost of a run taken out")


def fidelity(sizes: list[tuple[int, int]], photos: Path | None) -> None:
    cache = Path(os.environ.get("MMENC_BENCH_CACHE", "/tmp/mmenc-bench-cache")) / "feed"
    print("PSNR of --decode fast's model input against exact (dB, min / median):")
    for w, h in [*sizes, (4000, 3000)]:
        lo, mid = psnr_stats([p.read_bytes() for p in common.make_jpegs(cache, 32, (w, h))], 224)
        print(f"  generated {w}x{h} (32 images, input 224): {lo:.1f} / {mid:.1f}")
    found = real_photos(photos)
    if not found:
        print("  real photos: none (scikit-learn is not installed and no --photos DIR)")
        return
    for w, h in [(640, 480), (1920, 1080), (4000, 3000)]:  # each photo at that size's ratio to a 224 input
        edges = [max(8, round(224 * min(size) / min(w, h))) for size, _ in found]
        lo, mid = psnr_stats([data for _, data in found], edges)
        print(f"  real photos ({len(found)}) at the ratio of {w}x{h} to 224 (their short side / "
              f"{min(w, h) / 224:.2f}): {lo:.1f} / {mid:.1f}")


def real_photos(folder: Path | None) -> list[tuple[tuple[int, int], bytes]]:
    """((width, height), JPEG bytes) of scikit-learn's two photos and of the JPEGs and PNGs in
    `folder` (a PNG is encoded as a quality-90 JPEG first)."""
    import io

    from PIL import Image

    paths: list[Path] = []
    try:
        import sklearn.datasets

        paths += sorted((Path(sklearn.datasets.__file__).parent / "images").glob("*.jpg"))
    except ImportError:
        pass
    if folder is not None:
        paths += sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    found = []
    for path in paths:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            if im.format != "JPEG":
                buf = io.BytesIO()
                im.convert("RGB").save(buf, "JPEG", quality=90)
                data = buf.getvalue()
            found.append((im.size, data))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="640x480,1280x960,1920x1080")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--workers", type=int, default=None, help="decode workers (default: mmenc's, CPUs - 1)")
    ap.add_argument("--photos", type=Path, default=None, help="a folder of your own photos (JPEG, PNG) for the PSNR")
    ap.add_argument("--fidelity-only", action="store_true", help="only the PSNR part")
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    print(common.machine())
    if not args.fidelity_only:
        feed(sizes, args.images, args.workers)  # type: ignore[arg-type]
    fidelity(sizes, args.photos)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
