"""`--decode gpu` off the encode thread, proven on the CPU and on the fake CUDA layer.

* the next batch's JPEGs decode (on the decoder's own thread) while the current batch's forward
  is launched, not before it on the encode thread;
* images of one size are resized in one call, not one by one (huge ones in a few);
* refused JPEGs go back to the workers in small chunks that several workers share;
* a failed batched decode is bisected (only the refused image goes back), and an nvJPEG error that
  is a sticky device fault (by torch's words, by nvJPEG's CUDA status number, or found by
  synchronizing the decode stream after any failure) raises `DeviceError`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmenc_cli.encoders.base import ImageInput
from mmenc_cli.encoders.device_decode import DeviceJpegDecoder, is_nvjpeg_fault
from mmenc_cli.encoders.preprocess import PixelPreprocessor
from mmenc_cli.errors import DeviceError
from mmenc_cli.run.decode_pool import REFUSED_CHUNK, DecodePool
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import write_jsonl
from tests.fakes import fake_cuda_streams
from tests.run.test_gpu_decode import gpu_cfg, photo

PREP = PixelPreprocessor(None, 32, (32, 32), 3)


def jpegs(sizes: list[tuple[int, int]]) -> list[ImageInput]:
    return [ImageInput(np.frombuffer(photo(w, h, seed=i), np.uint8), {"jpeg": True}) for i, (w, h) in enumerate(sizes)]


def photo_manifest(folder: Path, n: int, size: tuple[int, int] = (64, 48)) -> Path:
    folder.mkdir(exist_ok=True)
    for i in range(n):
        (folder / f"p{i}.jpg").write_bytes(photo(*size, seed=i))
    return write_jsonl(folder / "m.jsonl", [{"id": f"p{i}", "image": f"p{i}.jpg"} for i in range(n)])


def test_the_next_batch_decodes_while_the_current_forward_is_launched(tmp_path: Path, tiny_clip: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 2 is handed to the decoder before batch 1's forward is launched, and its decode waits
    (on the decoder's thread) until that forward has been called: on the encode thread it would
    wait in vain. Batch 1's decode is held until batch 2 is handed over, so the order is fixed."""
    from mmenc_cli.encoders.torch_encoder import TorchEncoder

    manifest = photo_manifest(tmp_path / "media", 12)
    started, starts, decodes, forwards = threading.Event(), [], [], []
    first_forward = threading.Event()
    overlapped: list[bool] = []
    real_start, real_decode_all, real_encode = DeviceJpegDecoder.start, DeviceJpegDecoder._decode_all, TorchEncoder.encode

    def start(self: DeviceJpegDecoder, payloads: list[ImageInput]) -> Any:
        starts.append(threading.current_thread().name)
        if len(starts) == 2:
            started.set()
        return real_start(self, payloads)

    def decode_all(self: DeviceJpegDecoder, data: list[Any]) -> list[Any]:
        decodes.append(threading.current_thread().name)
        if len(decodes) == 1:  # batch 1's decode: held until batch 2 is handed over
            assert started.wait(timeout=20)
        elif len(decodes) == 2:  # batch 2's decode: finishes only once batch 1's forward is called
            overlapped.append(first_forward.wait(timeout=20))
        return real_decode_all(self, data)

    def encode(self: TorchEncoder, modality: str, payloads: Any) -> Any:
        if modality == "image" and len(payloads) == 4 and not first_forward.is_set():
            forwards.append(len(starts))  # batches handed to the decoder by then
            first_forward.set()
        return real_encode(self, modality, payloads)

    main = threading.current_thread().name
    monkeypatch.setattr(DeviceJpegDecoder, "start", start)
    monkeypatch.setattr(DeviceJpegDecoder, "_decode_all", decode_all)
    monkeypatch.setattr(TorchEncoder, "encode", encode)
    res = run_encode(gpu_cfg(manifest, tmp_path / "out", tiny_clip, "gpu", workers=0))
    assert res.counters.mod("image").encoded == 12 and res.counters.balanced
    assert overlapped == [True] and forwards == [2]
    assert set(starts) == {main} and {name.split("_")[0] for name in decodes} == {"mmenc-jpeg"}
    assert res.counters.seconds["device_decode"] > 0 and "device_decode_wait" in res.counters.seconds


def test_images_of_one_size_are_resized_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = DeviceJpegDecoder(PREP, "cpu")
    real = decoder.preprocess
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(decoder, "preprocess", lambda images: calls.append(tuple(images.shape)) or real(images))
    sizes = [(64, 48), (80, 60), (64, 48), (64, 48), (80, 60), (50, 90)]
    out = decoder(jpegs(sizes))
    decoder.close()
    assert sorted(calls) == [(1, 3, 90, 50), (2, 3, 60, 80), (3, 3, 48, 64)]
    assert all(o is not None and tuple(o.pixels.shape) == (3, 32, 32) for o in out)
    one_by_one = [DeviceJpegDecoder(PREP, "cpu")([p])[0] for p in jpegs(sizes)]
    for batched, alone in zip(out, one_by_one):  # the batch's pixels are each image's own
        assert torch.equal(batched.pixels, alone.pixels)


def test_a_group_of_huge_images_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """The resize works in float32: at most `GROUP_PIXELS` go into one call."""
    monkeypatch.setattr("mmenc_cli.encoders.device_decode.GROUP_PIXELS", 2 * 64 * 48)
    decoder = DeviceJpegDecoder(PREP, "cpu")
    real = decoder.preprocess
    calls: list[int] = []
    monkeypatch.setattr(decoder, "preprocess", lambda images: calls.append(len(images)) or real(images))
    out = decoder(jpegs([(64, 48)] * 5))
    decoder.close()
    assert calls == [2, 2, 1] and all(o is not None for o in out)


def test_refused_jpegs_are_shared_by_the_workers() -> None:
    pool = DecodePool.__new__(DecodePool)
    pool.workers = 3
    assert [len(c) for c in pool.spread(list(range(9)))] == [3, 3, 3]
    assert [len(c) for c in pool.spread(list(range(30)))] == [REFUSED_CHUNK] * 7 + [2]
    assert [len(c) for c in pool.spread([1])] == [1] and pool.spread([]) == []


def test_a_batch_s_refused_jpegs_go_back_in_small_chunks(tmp_path: Path, tiny_clip: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = photo_manifest(tmp_path / "media", 16)
    real_submit, chunks = DecodePool.submit, []

    def submit(self: DecodePool, key: Any, sources: Any, cpu_only: bool = False, modality: str = "image") -> None:
        if cpu_only:
            chunks.append(len(sources))
        real_submit(self, key, sources, cpu_only=cpu_only, modality=modality)

    monkeypatch.setattr(DecodePool, "submit", submit)
    monkeypatch.setattr(DeviceJpegDecoder, "_decode_all", lambda self, data: [None] * len(data))  # all refused
    cfg = gpu_cfg(manifest, tmp_path / "out", tiny_clip, "gpu", workers=0)
    cfg = cfg.__class__(**{**cfg.__dict__, "batch": cfg.batch.__class__(batch_size=16, workers=0)})
    res = run_encode(cfg)
    assert res.counters.mod("image").encoded == 16 and res.counters.balanced
    assert chunks == [REFUSED_CHUNK] * 4  # not one chunk of 16 for one worker


def test_a_failed_batch_decode_is_bisected(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    fake_cuda_streams(monkeypatch, log)
    decoder = DeviceJpegDecoder(PREP, "cuda:0")
    cpu_decode, calls = decoder.decode, []
    bad = 5

    def decode(data: list[Any], device: str) -> list[Any]:
        calls.append(len(data))
        if any(len(d) == bad for d in data):
            raise RuntimeError("Error while decoding JPEG images: Failed to get image info: 4")
        return cpu_decode(data, "cpu")

    decoder.decode = decode
    payloads = jpegs([(64, 48)] * 8)
    payloads[3] = ImageInput(np.frombuffer(b"\xff\xd8\xff\xe0\x00", np.uint8), {"jpeg": True})  # 5 bytes
    out = decoder(payloads)
    decoder.close()
    assert [o is None for o in out] == [False, False, False, True, False, False, False, False]
    assert calls == [8, 4, 2, 2, 1, 1, 4]  # halves, down to the one refused alone
    assert log.count("side synchronized") == 4  # after each failed call (8, 4, 2, 1): the device is still sound


@pytest.mark.parametrize("message, stream_fault", [
    ("Error while decoding JPEG images: Failed to synchronize CUDA stream: 700", None),
    ("CUDA error: an illegal memory access was encountered", None),
    ("Error while decoding JPEG images: Failed to decode batch: 6",
     torch.AcceleratorError("CUDA error: unspecified launch failure")),
], ids=["nvjpeg-cuda-status", "torch-words", "found-by-synchronizing"])
def test_a_sticky_nvjpeg_error_is_the_device_s(monkeypatch: pytest.MonkeyPatch, message: str,
                                               stream_fault: BaseException | None) -> None:
    log: list[str] = []
    fake_cuda_streams(monkeypatch, log, faults=[stream_fault] if stream_fault else None)
    decoder = DeviceJpegDecoder(PREP, "cuda:0")
    calls: list[int] = []

    def decode(data: list[Any], device: str) -> list[Any]:
        calls.append(len(data))
        raise RuntimeError(message)

    decoder.decode = decode
    with pytest.raises(DeviceError, match="while decoding JPEGs"):
        decoder(jpegs([(64, 48)] * 4))
    decoder.close()
    assert calls == [4]  # no image is blamed, no half tried


def test_nvjpeg_status_numbers_that_are_not_faults() -> None:
    assert is_nvjpeg_fault(RuntimeError("Failed to synchronize CUDA stream: 719"))
    assert not is_nvjpeg_fault(RuntimeError("Failed to synchronize CUDA stream: 2"))  # out of memory
    assert not is_nvjpeg_fault(RuntimeError("Failed to get image info: 700"))  # a status of nvJPEG's, not CUDA's
