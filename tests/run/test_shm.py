"""Decoded pixels in shared-memory slots: same pixels as pickled, bounded, and nothing left in /dev/shm.

The killed-run case (SIGKILL of the encode process) is in `tests/test_jobs.py`, which lists
`/dev/shm` before and after.
"""

from __future__ import annotations

from mmenc_cli.run.decode_worker import Preprocessors

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmenc_cli.config import MediaConfig
from mmenc_cli.encoders.base import ImageInput, ImagePreprocessor
from mmenc_cli.run import shm
from mmenc_cli.run.decode_pool import DecodePool
from mmenc_cli.run.decode_worker import Decoded
from tests.run.test_decode_pool import KILLER_SIZE, png

MEDIA = MediaConfig()
SIDE = 8


@dataclass
class Thumb(ImagePreprocessor):
    """A fixed 3 x 8 x 8 uint8 thumbnail; kills its worker (as a crashing decoder would) on an
    image of `KILLER_SIZE`."""

    def __call__(self, image: Image.Image) -> ImageInput:
        if image.size == KILLER_SIZE:
            os._exit(1)
        pixels = np.asarray(image.convert("RGB").resize((SIDE, SIDE)), dtype=np.uint8).transpose(2, 0, 1)
        return ImageInput(np.ascontiguousarray(pixels), {"orig_size": image.size})

    def max_pixel_bytes(self) -> int | None:
        return 3 * SIDE * SIDE


def segments() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith(shm.PREFIX)} if os.path.isdir("/dev/shm") else set()


def decode_all(pool: DecodePool, names: list[str], base: str, chunk: int = 3) -> list[Decoded]:
    for i in range(0, len(names), chunk):
        pool.submit(i, [(n, base) for n in names[i:i + chunk]])
    got: dict[int, list[Decoded]] = dict(pool.drain())
    return [d for i in sorted(got) for d in got[i]]


def reference(names: list[str], base: str) -> list[np.ndarray | None]:
    """The pixels of in-process decoding (no workers, nothing shared)."""
    pool = DecodePool(Preprocessors(image=Thumb()), MEDIA, workers=0, max_in_flight=64, slots=64)
    assert pool.slots is None
    return [d.value.pixels.copy() if d.value is not None else None for d in decode_all(pool, names, base)]


def test_pixels_come_in_slots_equal_to_in_process_decoding(tmp_path: Path, pools: list[DecodePool]) -> None:
    before = segments()
    names = [png(tmp_path, f"{i}.png", (10 + i, 9 + i), seed=i) for i in range(7)] + ["missing.png"]
    pool = DecodePool(Preprocessors(image=Thumb()), MEDIA, workers=2, max_in_flight=64, slots=32)
    pools.append(pool)
    assert pool.slots is not None and pool.slots.name in segments() - before
    got = decode_all(pool, names, str(tmp_path))
    ref = reference(names, str(tmp_path))
    assert [d.slot is not None for d in got] == [True] * 7 + [False]  # the missing file: an error, its slot freed
    assert got[-1].error is not None and got[-1].error.reason == "media.not_found"
    for dec, want in zip(got[:-1], ref[:-1]):
        np.testing.assert_array_equal(dec.value.pixels, want)
    assert pool.slots.free == 32 - 7
    for dec in got:
        pool.release(dec)
    assert pool.slots.free == 32
    pool.close()
    assert segments() - before == set()


def test_images_beyond_the_slots_travel_pickled(tmp_path: Path, pools: list[DecodePool]) -> None:
    names = [png(tmp_path, f"{i}.png", (12, 10), seed=i) for i in range(6)]
    pool = DecodePool(Preprocessors(image=Thumb()), MEDIA, workers=1, max_in_flight=64, slots=2)
    pools.append(pool)
    got = decode_all(pool, names, str(tmp_path), chunk=6)
    assert [d.slot is not None for d in got] == [True, True, False, False, False, False]
    for dec, want in zip(got, reference(names, str(tmp_path))):
        np.testing.assert_array_equal(dec.value.pixels, want)


def test_a_dead_worker_leaves_no_segment(tmp_path: Path, pools: list[DecodePool]) -> None:
    before = segments()
    names = [png(tmp_path, f"{i}.png", (10 + i, 9), seed=i) for i in range(5)]
    names.insert(2, png(tmp_path, "killer.png", KILLER_SIZE))
    pool = DecodePool(Preprocessors(image=Thumb()), MEDIA, workers=1, max_in_flight=64, slots=16)
    pools.append(pool)
    got = decode_all(pool, names, str(tmp_path))
    assert [d.error.reason if d.error else "ok" for d in got] == ["ok", "ok", "internal", "ok", "ok", "ok"]
    ref = reference([n for n in names if n != "killer.png"], str(tmp_path))
    for dec, want in zip([d for d in got if d.error is None], ref):
        np.testing.assert_array_equal(dec.value.pixels, want)  # the restarted pool writes the same segment
    pool.close(kill=True)
    deadline = time.monotonic() + 10
    while segments() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert segments() - before == set()


def test_no_room_in_dev_shm_means_pickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          pools: list[DecodePool]) -> None:
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 1, 256  # 256 bytes free: half of it is less than one slot

    monkeypatch.setattr(shm.os, "statvfs", lambda path: Full() if path == "/dev/shm" else real(path))
    pool = DecodePool(Preprocessors(image=Thumb()), MEDIA, workers=1, max_in_flight=8, slots=8)
    pools.append(pool)
    assert pool.slots is None
    names = [png(tmp_path, f"{i}.png", (12, 10), seed=i) for i in range(3)]
    got = decode_all(pool, names, str(tmp_path))
    assert [d.slot for d in got] == [None, None, None]
    for dec, want in zip(got, reference(names, str(tmp_path))):
        np.testing.assert_array_equal(dec.value.pixels, want)


def test_variable_sizes_are_never_put_in_slots(pools: list[DecodePool]) -> None:
    """A preprocessor without a size bound (Qwen's grids, shortest-edge resizes) ships pickled."""

    @dataclass
    class Free(Thumb):
        def max_pixel_bytes(self) -> int | None:
            return None

    pool = DecodePool(Preprocessors(image=Free()), MEDIA, workers=1, max_in_flight=8, slots=8)
    pools.append(pool)
    assert pool.slots is None


def test_the_segment_is_allocated_at_once_or_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages are reserved when the segment is made (a sparse one could promise more than /dev/shm
    holds, and a worker writing there would die of SIGBUS); when that fails, no segment is left."""
    import errno

    before = segments()
    calls: list[int] = []

    def full(fd: int, offset: int, size: int) -> None:
        calls.append(size)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", full)
    assert shm.shm_slots(8, 192) is None and calls == [8 * 192]
    assert segments() - before == set()


def test_closing_keeps_views_readable() -> None:
    """A payload dropped at a stop may still hold a view into a slot: closing unlinks the segment
    but leaves the mapping, so reading such a view never crashes."""
    pool = shm.SlotPool(2, 48)
    index = pool.acquire()
    view = pool.view(shm.Slot(index, (3, 4, 4)))
    view[...] = 7
    pool.close()
    assert pool.name not in segments()
    assert int(view.sum()) == 7 * 48


def test_video_frames_come_in_slots_too(tmp_path: Path, pools: list[DecodePool]) -> None:
    pytest.importorskip("av")
    from tests import mediafactory as mf

    clips = [mf.make_video(tmp_path / f"{i}.mp4", "mp4", seconds=1.0 + i).name for i in range(3)]
    names = clips + [mf.make_audio_only_mp4(tmp_path / "silent.mp4").name]
    pre = Preprocessors(image=Thumb(), frames=4)
    pool = DecodePool(pre, MEDIA, workers=1, max_in_flight=64, slots=24)
    pools.append(pool)
    pool.submit("clips", [(n, str(tmp_path)) for n in names], modality="video")
    [(_, got)] = list(pool.drain())
    local = DecodePool(pre, MEDIA, workers=0, max_in_flight=64)
    local.submit("clips", [(n, str(tmp_path)) for n in names], modality="video")
    [(_, ref)] = list(local.drain())
    assert [len(d.frames) for d in got] == [4, 4, 4, 0] and all(s is not None for d in got[:3] for s in d.frames)
    assert got[3].error is not None and got[3].error.code == 422  # its four slots freed at once
    for dec, want in zip(got[:3], ref[:3]):
        for frame, wanted in zip(dec.value.frames, want.value.frames):
            np.testing.assert_array_equal(frame.pixels, wanted.pixels)
    assert pool.slots is not None and pool.slots.free == 24 - 12
    for dec in got:
        pool.release(dec)
    assert pool.slots.free == 24
