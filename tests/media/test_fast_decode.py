"""`--decode fast`: a JPEG at least four times the model's input on both sides decodes at a reduced
DCT scale keeping twice what the resize needs (EXIF rotations included), the resize runs on torch's
antialiased uint8 kernels (Pillow's bilinear and bicubic within a level); the pixels stay close to
the exact ones, other filters and formats decode as in exact mode; the mode is part of the output's fingerprint and an output
written before the mode existed resumes as `exact`."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from mmenc_cli.config import MediaConfig
from mmenc_cli.encoders.preprocess import PixelPreprocessor
from mmenc_cli.errors import OutputError
from mmenc_cli.media.decode import decode_image
from mmenc_cli.output import OutDir
from mmenc_cli.run.decode_worker import Preprocessors, decode_one
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, _vec, factory
from tests.runs import embeddings, make_cfg

CLIP = PixelPreprocessor(None, 224, (224, 224), 3)  # CLIP's: shortest edge 224, bicubic, crop 224
FAST = CLIP.for_fast_decode()
ROOT = Path(__file__).resolve().parents[2]


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


def test_draft_size_is_twice_what_the_resize_needs_when_it_is_a_quarter_or_less() -> None:
    assert CLIP.draft_size(1280, 960) == (596, 448) and CLIP.draft_size(960, 1280) == (448, 596)
    assert CLIP.draft_size(1192, 896) == (2 * 298, 448) and CLIP.draft_size(1280, 895) is None
    assert CLIP.draft_size(640, 480) is None  # a reduced decode would leave the resize under a factor 2
    assert PixelPreprocessor((32, 48), None, None, 2).draft_size(192, 128) == (96, 64)
    assert PixelPreprocessor(None, None, (32, 32), 2).draft_size(4000, 3000) is None  # no resize: nothing to spare


@pytest.mark.parametrize("orientation", [None, 2, 3, 4, 5, 6, 7, 8])
def test_a_large_jpeg_decodes_at_the_scale_that_keeps_twice_the_resize(orientation: int | None) -> None:
    data = jpeg(scene(1280, 960), orientation)
    exact = decode_image(data, MediaConfig(), None)
    fast = decode_image(data, MediaConfig(), None, draft=CLIP.draft_size)
    upright = (960, 1280) if orientation in (5, 6, 7, 8) else (1280, 960)
    assert exact.size == upright and fast.size == (upright[0] // 2, upright[1] // 2)
    short = min(fast.size)
    assert short >= 2 * 224 and short // 2 < 2 * 224  # the largest reduction keeping twice the resize
    a, b = CLIP(exact).pixels, FAST(fast).pixels
    assert a.shape == b.shape == (3, 224, 224) and psnr(a, b) >= 40


@pytest.mark.parametrize("orientation", [None, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("fast", [False, True])
def test_a_reduced_decode_keeps_the_full_images_geometry(orientation: int | None, fast: bool) -> None:
    """1803x1201 at 1/4 is 451x301 (rounded up): the resize's target comes from the full size
    (150x100, not the reduced image's 149x100) and the resize takes the part of the reduced image
    the full one covers, wherever an EXIF turn put the partial pixels. Without either, the pixels
    shift and fine detail falls far below 30 dB."""
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (1201 // 5, 1803 // 5, 3), dtype=np.uint8))
    image = image.resize((1803, 1201), Image.NEAREST)  # 5-pixel tiles: fine detail at 1/4
    data, model = jpeg(image, orientation), PixelPreprocessor(None, 100, (100, 100), 3)
    reduced = decode_image(data, MediaConfig(), None, draft=model.draft_size)
    turned = orientation in (5, 6, 7, 8)
    assert reduced.size == ((301, 451) if turned else (451, 301))
    exact = model(decode_image(data, MediaConfig(), None)).pixels
    got = (model.for_fast_decode() if fast else model)(reduced).pixels
    assert psnr(exact, got) >= 30


def test_only_large_jpegs_are_reduced() -> None:
    small = jpeg(scene(1000, 800))  # under four times 224 on the short side
    assert decode_image(small, MediaConfig(), None, draft=CLIP.draft_size).size == (1000, 800)
    buf = io.BytesIO()
    scene(2560, 1920).save(buf, "PNG")  # PNG has no reduced decoding
    assert decode_image(buf.getvalue(), MediaConfig(), None, draft=CLIP.draft_size).size == (2560, 1920)


@pytest.mark.parametrize("resample", [2, 3])  # bilinear, bicubic: torch's antialiased uint8 kernels
@pytest.mark.parametrize("size", [(640, 480), (1280, 960), (300, 200), (120, 90), (224, 600), (1000, 60)])
def test_fast_resizing_is_pillows_filter_within_a_level(resample: int, size: tuple[int, int]) -> None:
    exact_pre = PixelPreprocessor(None, 224, (224, 224), resample)
    image = scene(*size)
    exact, fast = exact_pre(image).pixels, exact_pre.for_fast_decode()(image).pixels
    assert exact.shape == fast.shape == (3, 224, 224) and fast.flags.c_contiguous
    diff = np.abs(exact.astype(np.int16) - fast.astype(np.int16))
    assert diff.max() <= 2 and diff.mean() < 0.05, (diff.max(), diff.mean())


@pytest.mark.parametrize("resample", [0, 1, 4, 5])  # nearest, Lanczos, box, Hamming: Pillow's own
def test_other_filters_resize_with_pillow_in_fast_mode_too(resample: int) -> None:
    pre = PixelPreprocessor((100, 150), None, None, resample)
    image = scene(640, 480)
    assert not pre.for_fast_decode().imports_torch()
    assert np.array_equal(pre(image).pixels, pre.for_fast_decode()(image).pixels)


def test_exact_preprocessing_never_imports_torch() -> None:
    """Exact mode's workers stay light: the uint8 path imports numpy and Pillow only."""
    code = ("import sys; from PIL import Image; from mmenc_cli.encoders.preprocess import PixelPreprocessor;"
            "pre = PixelPreprocessor(None, 224, (224, 224), 3);"
            "pre(Image.new('RGB', (640, 480))); assert not pre.imports_torch();"
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "pre.for_fast_decode()(Image.new('RGB', (640, 480))); assert 'torch' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_real_photos_stay_close() -> None:
    """The photos scikit-learn ships (640x427), for a 100-pixel input (427 >= 4 x 100): a reduced
    decode at 1/2 (not 1/4, which leaves the resize almost nothing to antialias)."""
    datasets = pytest.importorskip("sklearn.datasets")
    model = PixelPreprocessor(None, 100, (100, 100), 3)
    folder = Path(datasets.__file__).parent / "images"
    photos = sorted(folder.glob("*.jpg"))
    assert photos
    for photo in photos:
        data = photo.read_bytes()
        exact = model(decode_image(data, MediaConfig(), None)).pixels
        fast_image = decode_image(data, MediaConfig(), None, draft=model.draft_size)
        assert fast_image.size == (320, 214)
        assert psnr(exact, model.for_fast_decode()(fast_image).pixels) >= 35, photo.name


def test_the_worker_takes_the_mode_from_its_media_config(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    path.write_bytes(jpeg(scene(1280, 960)))
    exact = decode_one(str(path), "", Preprocessors(image=CLIP), MediaConfig(decode="exact")).value
    fast = decode_one(str(path), "", Preprocessors(image=CLIP), MediaConfig(decode="fast")).value
    assert exact is not None and fast is not None and exact.pixels.shape == fast.pixels.shape
    assert not np.array_equal(exact.pixels, fast.pixels) and psnr(exact.pixels, fast.pixels) >= 40


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


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_a_run_preprocesses_as_its_mode_says_in_its_workers(tmp_path: Path, mode: str) -> None:
    """Through real decode workers: fast mode's vectors are those of the fast preprocessing (a
    reduced decode, torch's resize), exact mode's those of the processor's own pixels."""
    small = PixelPreprocessor(None, 64, (64, 64), 3)
    encoder = replace(FakeEncoder(), modalities=frozenset({"image"}))
    encoder.image_preprocessor = lambda: small  # type: ignore[method-assign]
    rows, expected = [], {}
    for i, size in enumerate([(640, 480), (300, 200)]):  # reduced at 1/2; never reduced
        path = tmp_path / f"p{i}.jpg"
        path.write_bytes(jpeg(scene(*size, seed=i)))
        rows.append(json.dumps({"id": f"p{i}", "image": str(path)}) + "\n")
        pre = small.for_fast_decode() if mode == "fast" else small
        image = decode_image(path.read_bytes(), MediaConfig(), None, small.draft_size if mode == "fast" else None)
        expected[f"p{i}"] = _vec(pre(image).pixels.tobytes(), encoder.dim)
    (tmp_path / "m.jsonl").write_text("".join(rows))
    cfg = make_cfg([tmp_path / "m.jsonl"], tmp_path / "out", workers=1)
    cfg = replace(cfg, media=replace(cfg.media, decode=mode))
    assert run_encode(cfg, encoder_factory=factory(encoder)).counters.encoded == 2
    got = {i: v for (i, _), v in embeddings(tmp_path / "out").items()}
    assert got.keys() == expected.keys()
    for key, vector in expected.items():
        assert np.array_equal(got[key], vector), key
    plain = [_vec(small(decode_image((tmp_path / f"p{i}.jpg").read_bytes(), MediaConfig(), None)).pixels.tobytes(), 8)
             for i in range(2)]
    assert (mode == "exact") == all(np.array_equal(got[f"p{i}"], plain[i]) for i in range(2))


def test_the_workers_forkserver_starts_before_the_model_loads_where_images_may_come(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its torch import (for the fast resize) then overlaps the model's load; a text-only run on the
    CPU, exact mode and in-process decoding never start it."""
    from mmenc_cli.run import admission
    from mmenc_cli.run.decode_pool import workers_start_early

    path = tmp_path / "a.jpg"
    path.write_bytes(jpeg(scene(320, 240)))
    (tmp_path / "m.jsonl").write_text(json.dumps({"id": "a", "image": str(path)}) + "\n")
    cfg = make_cfg([tmp_path / "m.jsonl"], tmp_path / "out", workers=1)
    cfg = replace(cfg, media=replace(cfg.media, decode="fast"))  # as a run resolves it before the load
    images = replace(cfg, modalities=("image",))
    assert workers_start_early(images, "cpu") and workers_start_early(cfg, "cuda:0")
    assert not workers_start_early(cfg, "cpu") and not workers_start_early(replace(cfg, modalities=("text",)), "cuda")
    assert not workers_start_early(replace(images, media=replace(images.media, decode="exact")), "cpu")
    assert not workers_start_early(replace(images, batch=replace(images.batch, workers=0)), "cpu")
    events: list[str] = []
    monkeypatch.setattr(admission, "start_forkserver", lambda torch: events.append(f"forkserver torch={torch}"))

    def load(cfg: object, device: object = None) -> FakeEncoder:
        events.append("load")
        return replace(FakeEncoder(), modalities=frozenset({"image"}))

    assert run_encode(images, encoder_factory=load).counters.encoded == 1
    assert events == ["forkserver torch=True", "load"]
