"""`--decode gpu`, proven on the CPU: the same code with torchvision's CPU JPEG decoder.

Workers send a JPEG the device can decode as its bytes; the encode process decodes a batch's JPEGs
in one call, resizes and crops them there; anything else (PNG, CMYK, EXIF-rotated) decodes in the
workers, and a JPEG the decoder refuses goes back to the workers, where a corrupt one becomes
exactly one 400 error row without failing its batch.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmenc_cli.config import BatchConfig, MediaConfig, ModelConfig, RunConfig, WriterConfig
from mmenc_cli.encoders import load_encoder
from mmenc_cli.encoders.base import ImageInput
from mmenc_cli.encoders.device_decode import DeviceJpegDecoder
from mmenc_cli.encoders.preprocess import PixelPreprocessor
from mmenc_cli.errors import DeviceError, ModelLoadError
from mmenc_cli.media.decode import decode_image, device_jpeg
from mmenc_cli.run.decode_worker import Preprocessors, decode_one
from mmenc_cli.output import OutDir
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import write_jsonl
from tests.fakes import FakeEncoder, factory, fake_cuda_streams
from tests.runs import embeddings, error_rows

MEDIA = MediaConfig()


def photo(width: int, height: int, seed: int = 0, mode: str = "RGB", exif: int | None = None) -> bytes:
    """A smooth, photo-like JPEG (gradients and a shape), quality 90."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([xx / width * 255, yy / height * 255, (xx + yy) / (width + height) * 255], axis=-1)
    base += rng.normal(0, 3, base.shape)
    im = Image.fromarray(base.clip(0, 255).astype(np.uint8)).convert(mode)
    out = io.BytesIO()
    kwargs: dict[str, Any] = {"quality": 90}
    if exif is not None:
        ex = Image.Exif()
        ex[0x0112] = exif
        kwargs["exif"] = ex
    im.save(out, "JPEG", **kwargs)
    return out.getvalue()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.mark.parametrize("prep", [PixelPreprocessor(None, 32, (32, 32), 3),
                                  PixelPreprocessor((40, 48), None, (32, 32), 2, rounded_crop=True),
                                  PixelPreprocessor(None, 224, (224, 224), 3)],
                         ids=["shortest-edge-bicubic", "fixed-size-bilinear-rounded", "clip-224"])
@pytest.mark.parametrize("size", [(640, 480), (200, 120), (90, 300)])
def test_device_pixels_are_close_to_the_cpu_path(prep: PixelPreprocessor, size: tuple[int, int]) -> None:
    data = photo(*size, seed=size[0])
    [got] = DeviceJpegDecoder(prep, "cpu")([ImageInput(np.frombuffer(data, np.uint8), {"jpeg": True})])
    want = prep(decode_image(data, MEDIA, None)).pixels
    assert got is not None and tuple(got.pixels.shape) == want.shape
    assert psnr(got.pixels.numpy(), want) >= 30.0


def test_refused_jpegs_come_back_as_none_and_others_pass_through() -> None:
    good, bad = photo(64, 48, 1), photo(64, 48, 2)[:400]  # the second one cut short
    png = ImageInput(np.zeros((3, 32, 32), np.uint8))
    out = DeviceJpegDecoder(PixelPreprocessor(None, 32, (32, 32), 3), "cpu")(
        [ImageInput(np.frombuffer(good, np.uint8), {"jpeg": True}), png,
         ImageInput(np.frombuffer(bad, np.uint8), {"jpeg": True})])
    assert out[0] is not None and tuple(out[0].pixels.shape) == (3, 32, 32)
    assert out[1] is png and out[2] is None


def test_workers_keep_only_plain_jpegs_encoded(tmp_path: Path) -> None:
    prep, gpu = Preprocessors(image=PixelPreprocessor(None, 32, (32, 32), 3)), MediaConfig(decode="gpu")
    files = {"rgb.jpg": photo(64, 48), "grey.jpg": photo(64, 48, mode="L"), "cmyk.jpg": photo(64, 48, mode="CMYK"),
             "turned.jpg": photo(64, 48, exif=6)}
    png = io.BytesIO()
    Image.new("RGB", (40, 30), (9, 9, 9)).save(png, "PNG")
    files["image.png"] = png.getvalue()
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    kinds = {}
    for name in files:
        dec = decode_one(name, str(tmp_path), prep, gpu)
        assert dec.error is None
        kinds[name] = "bytes" if dec.value.meta.get("jpeg") else tuple(dec.value.pixels.shape)
    assert kinds == {"rgb.jpg": "bytes", "grey.jpg": "bytes", "cmyk.jpg": (3, 32, 32), "turned.jpg": (3, 32, 32),
                     "image.png": (3, 32, 32)}
    assert decode_one("rgb.jpg", str(tmp_path), prep, gpu, cpu_only=True).value.pixels.shape == (3, 32, 32)
    assert not device_jpeg(files["image.png"], MEDIA)


def test_the_pixel_limit_holds_for_jpegs_sent_as_bytes(tmp_path: Path) -> None:
    (tmp_path / "big.jpg").write_bytes(photo(200, 100))
    dec = decode_one("big.jpg", str(tmp_path), Preprocessors(image=PixelPreprocessor(None, 32, (32, 32), 3)),
                     MediaConfig(decode="gpu", max_image_pixels=10_000))
    assert dec.error is not None and (dec.error.code, dec.error.reason) == (413, "media.too_large")


def gpu_cfg(manifest: Path, out: Path, model: Path, decode: str, workers: int = 1) -> RunConfig:
    return RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(model), device="cpu"),
                     writer=WriterConfig(out=str(out), shard_size=5), batch=BatchConfig(batch_size=4, workers=workers),
                     media=MediaConfig(decode=decode, fetch_retries=0), modalities=("image",))


def test_a_run_accounts_for_every_image_and_a_corrupt_jpeg_is_one_400(tmp_path: Path, tiny_clip: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    media = tmp_path / "media"
    media.mkdir()
    rows = []
    for i in range(9):
        (media / f"p{i}.jpg").write_bytes(photo(64 + 8 * i, 48 + 4 * i, seed=i))
        rows.append({"id": f"p{i}", "image": f"p{i}.jpg"})
    (media / "cmyk.jpg").write_bytes(photo(64, 48, mode="CMYK"))
    cut = photo(80, 60, seed=99)
    (media / "cut.jpg").write_bytes(cut[:len(cut) * 3 // 4])  # the header whole, the scan cut short
    (media / "refused.jpg").write_bytes(photo(72, 56, seed=7))
    Image.new("RGB", (50, 40), (200, 10, 10)).save(media / "red.png")
    rows += [{"id": n.split(".")[0], "image": n} for n in ("cmyk.jpg", "cut.jpg", "refused.jpg", "red.png")]
    manifest = write_jsonl(media / "m.jsonl", rows)

    refused_size = len((media / "refused.jpg").read_bytes())
    real = DeviceJpegDecoder._decode_all
    seen: list[int] = []

    def decode_all(self: DeviceJpegDecoder, data: list[Any]) -> list[Any]:
        seen.extend(len(d) for d in data)
        got = real(self, data)
        return [None if len(d) == refused_size else g for d, g in zip(data, got)]  # the decoder says no

    monkeypatch.setattr(DeviceJpegDecoder, "_decode_all", decode_all)
    res = run_encode(gpu_cfg(manifest, tmp_path / "gpu", tiny_clip, "gpu"))
    counts = res.counters.mod("image")
    assert counts.requested == 13 and counts.encoded == 12 and counts.failed == {400: 1} and res.counters.balanced
    [err] = error_rows(tmp_path / "gpu")
    assert (err["id"], err["code"], err["reason"]) == ("cut", 400, "media.unreadable")
    assert refused_size in seen and len(seen) == 11  # 9 photos, the cut one and the refused one went to the device
    assert res.counters.seconds["device_decode"] > 0
    run_json = json.loads((tmp_path / "gpu" / "_mmenc" / "run.json").read_text())
    assert run_json["fingerprint"]["decode"] == "gpu"

    exact = run_encode(gpu_cfg(manifest, tmp_path / "exact", tiny_clip, "exact"))
    assert exact.counters.mod("image").encoded == 12
    a, b = embeddings(tmp_path / "gpu"), embeddings(tmp_path / "exact")
    assert a.keys() == b.keys()
    for key in a:
        cos = float(a[key] @ b[key] / (np.linalg.norm(a[key]) * np.linalg.norm(b[key])))
        assert cos > 0.99, (key, cos)


def test_without_torchvision_the_run_says_which_extra(tmp_path: Path, tiny_clip: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "image": "a.jpg"}])
    with pytest.raises(ModelLoadError, match=r"mmenc\[gpu\]") as info:
        run_encode(gpu_cfg(manifest, tmp_path / "out", tiny_clip, "gpu", workers=0))
    assert info.value.exit_code == 3


def test_a_model_without_a_device_path_refuses_gpu_decoding(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(photo(64, 48))
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "image": "a.jpg"}])
    cfg = gpu_cfg(manifest, tmp_path / "out", tmp_path, "gpu", workers=0)
    with pytest.raises(ModelLoadError, match="use --decode fast"):
        run_encode(cfg, encoder_factory=factory(FakeEncoder()))


def test_the_tiny_clip_offers_a_device_decoder(tiny_clip: Path) -> None:
    encoder = load_encoder(ModelConfig(model=str(tiny_clip), device="cpu"))
    assert isinstance(encoder.image_device_decoder(), DeviceJpegDecoder)


def jpeg_payloads(n: int) -> list[ImageInput]:
    return [ImageInput(np.frombuffer(photo(64, 48, seed=i), np.uint8), {"jpeg": True}) for i in range(n)]


def test_a_sticky_device_error_while_decoding_ends_the_run(tmp_path: Path, tiny_clip: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    media = tmp_path / "media"
    media.mkdir()
    for i in range(12):
        (media / f"p{i}.jpg").write_bytes(photo(64, 48, seed=i))
    manifest = write_jsonl(media / "m.jsonl", [{"id": f"p{i}", "image": f"p{i}.jpg"} for i in range(12)])
    calls: list[int] = []
    real = DeviceJpegDecoder._decode_all

    def decode_all(self: DeviceJpegDecoder, data: list[Any]) -> list[Any]:
        calls.append(len(data))
        if len(calls) == 2:
            self.decode = lambda d, dev: (_ for _ in ()).throw(RuntimeError(
                "CUDA error: an illegal memory access was encountered"))
        return real(self, data)

    monkeypatch.setattr(DeviceJpegDecoder, "_decode_all", decode_all)
    with pytest.raises(DeviceError) as info:
        run_encode(gpu_cfg(manifest, tmp_path / "out", tiny_clip, "gpu", workers=0))
    assert info.value.exit_code == 1
    [meta] = OutDir(tmp_path / "out").read_task_metas()
    image = meta["counters"]["modalities"]["image"]
    assert meta["state"] == "failed" and meta["counters"]["balanced"] and image["not_attempted"] > 0
    assert error_rows(tmp_path / "out") == []


def test_an_image_the_device_cannot_resize_is_decoded_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Images of one size are resized in one call; when that fails, one by one, and the one that
    fails alone goes back to the workers."""
    import torch

    decoder = DeviceJpegDecoder(PixelPreprocessor(None, 32, (32, 32), 3), "cpu")
    real = decoder.preprocess
    seen: list[int] = []

    def preprocess(images: Any) -> Any:
        seen.append(len(images))
        if len(images) > 1 or len(seen) == 3:  # the group, then the second image alone
            raise torch.OutOfMemoryError("Tried to allocate 9.00 GiB")
        return real(images)

    monkeypatch.setattr(decoder, "preprocess", preprocess)
    out = decoder(jpeg_payloads(3))
    assert [o is None for o in out] == [False, True, False]
    assert seen == [3, 1, 1, 1]


def test_jpegs_are_decoded_on_a_stream_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the decode runs on a thread (whose current device is the model's) and a side stream
    of its own; the caller's stream waits for the event recorded after the batch's kernels, and
    the decoded images' memory is marked as used on the caller's stream (a fake CUDA stream API
    records the order)."""
    log: list[str] = []
    fake_cuda_streams(monkeypatch, log)
    decoder = DeviceJpegDecoder(PixelPreprocessor(None, 32, (32, 32), 3), "cuda:1")
    cpu_decode = decoder.decode
    decoder.decode = lambda data, device: (log.append(f"decode {len(data)}"), cpu_decode(data, "cpu"))[1]
    out = decoder(jpeg_payloads(2))
    decoder.close()
    assert all(o is not None for o in out)
    assert log == ["device 1", "on side", "decode 2", "event on side", "off side",
                   "current waits for the event on side", "used on current"]  # one tensor holds both
