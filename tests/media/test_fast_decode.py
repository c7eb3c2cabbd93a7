"""`--decode fast`: a JPEG at least twice the model's input on both sides decodes at a reduced DCT
scale. It covers what the resize needs (EXIF rotations included), stays close to the exact
pixels, is refused for everything else; the mode is part of the output's fingerprint and an output
written before the mode existed resumes as `exact`."""

from __future__ import annotations

from mmenc_cli.run.decode_worker import Preprocessors

import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from mmenc_cli.config import MediaConfig
from mmenc_cli.encoders.preprocess import PixelPreprocessor
from mmenc_cli.errors import OutputError
from mmenc_cli.media.decode import decode_image
from mmenc_cli.outdir import OutDir
from mmenc_cli.run.decode_worker import decode_one
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg

CLIP = PixelPreprocessor(None, 224, (224, 224), 3)  # CLIP's: shortest edge 224, bicubic, crop 224


def scene(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth photo-like picture: two gradients, a few ellipses, a little noise."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    pixels = 255 * (0.6 * x * rng.random(3) + 0.4 * y * rng.random(3))
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.integers(0, width - 10), rng.integers(0, height - 10)
        box = (x0, y0, x0 + rng.integers(10, width // 2), y0 + rng.integers(10, height // 2))
        draw.ellipse(box, fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    noisy = np.asarray(image, dtype=np.int16) + rng.integers(-6, 7, (height, width, 3))
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def jpeg(image: Image.Image, orientation: int | None = None) -> bytes:
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    image.save(buf, "JPEG", quality=90, exif=exif.tobytes())
    return buf.getvalue()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def test_draft_size_is_what_the_resize_needs_when_it_is_half_or_less() -> None:
    assert CLIP.draft_size(1280, 960) == (298, 224) and CLIP.draft_size(960, 1280) == (224, 298)
    assert CLIP.draft_size(640, 480) == (298, 224) and CLIP.draft_size(640, 447) is None
    assert PixelPreprocessor((32, 48), None, None, 2).draft_size(96, 64) == (48, 32)
    assert PixelPreprocessor(None, None, (32, 32), 2).draft_size(4000, 3000) is None  # no resize: nothing to spare


@pytest.mark.parametrize("orientation", [None, 6, 8, 3])
def test_a_large_jpeg_decodes_at_the_scale_that_covers_the_resize(orientation: int | None) -> None:
    data = jpeg(scene(1280, 960), orientation)
    exact = decode_image(data, MediaConfig(), None)
    fast = decode_image(data, MediaConfig(), None, draft=CLIP.draft_size)
    upright = (960, 1280) if orientation in (6, 8) else (1280, 960)
    assert exact.size == upright and fast.size == (upright[0] // 4, upright[1] // 4)  # 1/4 covers 298x224
    short = min(fast.size)
    assert short >= 224 and short // 2 < 224  # the largest reduction that still covers the resize
    a, b = CLIP(exact).pixels, CLIP(fast).pixels
    assert a.shape == b.shape == (3, 224, 224) and psnr(a, b) >= 30


def test_only_large_jpegs_are_reduced() -> None:
    small = jpeg(scene(600, 440))  # under twice 224 on the short side
    assert decode_image(small, MediaConfig(), None, draft=CLIP.draft_size).size == (600, 440)
    buf = io.BytesIO()
    scene(1280, 960).save(buf, "PNG")  # PNG has no reduced decoding
    assert decode_image(buf.getvalue(), MediaConfig(), None, draft=CLIP.draft_size).size == (1280, 960)


def test_real_photos_stay_close() -> None:
    """The photos scikit-learn ships (640x427), for a 160-pixel input (427 >= 2 x 160)."""
    datasets = pytest.importorskip("sklearn.datasets")
    model = PixelPreprocessor(None, 160, (160, 160), 3)
    folder = Path(datasets.__file__).parent / "images"
    for photo in sorted(folder.glob("*.jpg")):
        data = photo.read_bytes()
        exact = model(decode_image(data, MediaConfig(), None)).pixels
        fast_image = decode_image(data, MediaConfig(), None, draft=model.draft_size)
        assert fast_image.size == (320, 214)
        assert psnr(exact, model(fast_image).pixels) >= 30, photo.name


def test_the_worker_takes_the_mode_from_its_media_config(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    path.write_bytes(jpeg(scene(1280, 960)))
    exact = decode_one(str(path), "", Preprocessors(image=CLIP), MediaConfig(decode="exact")).value
    fast = decode_one(str(path), "", Preprocessors(image=CLIP), MediaConfig(decode="fast")).value
    assert exact is not None and fast is not None and exact.pixels.shape == fast.pixels.shape
    assert not np.array_equal(exact.pixels, fast.pixels) and psnr(exact.pixels, fast.pixels) >= 30


def test_the_mode_is_in_the_fingerprint_and_old_outputs_resume_exact(tmp_path: Path) -> None:
    rows = (json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(4))
    (tmp_path / "m.jsonl").write_text("".join(rows))
    manifest, out = tmp_path / "m.jsonl", tmp_path / "out"
    run_encode(make_cfg([manifest], out), encoder_factory=factory(FakeEncoder()))
    meta = OutDir(out).read_run_meta()
    assert meta["fingerprint"]["decode"] == "fast" and meta["config"]["media"]["decode"] == "fast"
    del meta["fingerprint"]["decode"]  # an output written before --decode existed
    OutDir(out).run_meta_path.write_text(json.dumps(meta))
    again = run_encode(make_cfg([manifest], out), encoder_factory=factory(FakeEncoder()))
    assert again.state == "done"  # resumed, as exact
    fast = make_cfg([manifest], out)
    fast = replace(fast, media=replace(fast.media, decode="fast"))  # asked for explicitly: refused
    with pytest.raises(OutputError, match="decode: output has 'exact', this run 'fast'"):
        run_encode(fast, encoder_factory=factory(FakeEncoder()))
