"""Unit tests of `mmenc_cli.run.decode_pool`: ordered, bounded decoding in- and out-of-process.

The preprocessors are module-level classes so that worker processes (forkserver) can unpickle
them by module path. Images are small PNG files whose sizes identify them in the results.
"""

from __future__ import annotations

from mmenc_cli.run.decode_worker import Preprocessors

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from PIL import Image

from mmenc_cli.config import MediaConfig
from mmenc_cli.encoders.base import ImageInput, ImagePreprocessor
from mmenc_cli.errors import MMError
from mmenc_cli.run.decode_pool import DecodePool
from mmenc_cli.run.decode_worker import Decoded, decode_one, item_deadline

MEDIA = MediaConfig()
KILLER_SIZE = (13, 7)  # an image of this size makes `ExitingPreprocessor` kill its worker


@dataclass
class ArrayPreprocessor(ImagePreprocessor):
    """The decoded RGB pixels as they are ([height, width, 3] uint8), plus the worker's pid."""

    def __call__(self, image: Image.Image) -> ImageInput:
        return ImageInput(np.asarray(image, dtype=np.uint8), {"orig_size": image.size, "pid": os.getpid()})


@dataclass
class SleepyPreprocessor(ArrayPreprocessor):
    """Like `ArrayPreprocessor`, after a short sleep (keeps a chunk in flight for a while)."""

    seconds: float = 0.3

    def __call__(self, image: Image.Image) -> ImageInput:
        time.sleep(self.seconds)
        return super().__call__(image)


@dataclass
class ExitingPreprocessor(ArrayPreprocessor):
    """Kills its process (as a segfaulting decoder would) on an image of `KILLER_SIZE`."""

    def __call__(self, image: Image.Image) -> ImageInput:
        if image.size == KILLER_SIZE:
            os._exit(1)
        return super().__call__(image)


@dataclass
class FailingPreprocessor(ArrayPreprocessor):
    """Raises on images wider than 30 pixels."""

    def __call__(self, image: Image.Image) -> ImageInput:
        if image.size[0] > 30:
            raise ArithmeticError(f"cannot preprocess an image of width {image.size[0]}")
        return super().__call__(image)


@dataclass
class HangingPreprocessor(ArrayPreprocessor):
    """Hangs (as a stuck library call would) on images 31 pixels wide, noting each start in `log`."""

    log: str = ""

    def __call__(self, image: Image.Image) -> ImageInput:
        if image.size[0] == 31:
            with open(self.log, "a") as fh:
                fh.write(f"{os.getpid()}\n")
            time.sleep(120)
        return super().__call__(image)


def png(folder: Path, name: str, size: tuple[int, int], seed: int = 0) -> str:
    """Write a small random RGB PNG of `size` (width, height); return its file name."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(folder / name)
    return name


def shape_of(size: tuple[int, int]) -> tuple[int, int, int]:
    """The pixel array shape `ArrayPreprocessor` gives an image of `size` (width, height)."""
    return (size[1], size[0], 3)


def shapes(results: list[Decoded]) -> list[Any]:
    """Per item: its pixel shape, or its error's reason."""
    return [d.value.pixels.shape if d.error is None else d.error.reason for d in results]


def make_pool(pools: list[DecodePool], preprocessor: Any, workers: int, max_in_flight: int = 64) -> DecodePool:
    pool = DecodePool(Preprocessors(image=preprocessor), MEDIA, workers=workers, max_in_flight=max_in_flight)
    pools.append(pool)
    return pool


# -- decode_one -----------------------------------------------------------------------------------

def test_decode_one_ok(tmp_path: Path) -> None:
    name = png(tmp_path, "a.png", (20, 10))
    d = decode_one(name, str(tmp_path), Preprocessors(image=ArrayPreprocessor()), MEDIA)
    assert d.error is None
    assert d.value.pixels.shape == (10, 20, 3) and d.value.pixels.dtype == np.uint8
    assert d.value.meta["orig_size"] == (20, 10)
    np.testing.assert_array_equal(d.value.pixels, np.asarray(Image.open(tmp_path / name).convert("RGB")))
    assert len(d.seconds) == 2 and all(s >= 0 for s in d.seconds)


def test_decode_one_missing_and_garbage(tmp_path: Path) -> None:
    missing = decode_one("nope.png", str(tmp_path), Preprocessors(image=ArrayPreprocessor()), MEDIA)
    assert missing.value is None
    assert (missing.error.code, missing.error.reason, missing.error.stage) == (404, "media.not_found", "load")

    (tmp_path / "junk.png").write_bytes(b"this is not an image at all" * 10)
    junk = decode_one("junk.png", str(tmp_path), Preprocessors(image=ArrayPreprocessor()), MEDIA)
    assert junk.value is None
    assert (junk.error.code, junk.error.reason, junk.error.stage) == (400, "media.unreadable", "decode")


def test_decode_one_preprocess_exception(tmp_path: Path) -> None:
    name = png(tmp_path, "wide.png", (40, 10))
    d = decode_one(name, str(tmp_path), Preprocessors(image=FailingPreprocessor()), MEDIA)
    assert d.value is None and isinstance(d.error, MMError)
    assert (d.error.stage, d.error.reason, d.error.code, d.error.error) == \
        ("preprocess", "preprocess.failed", 500, "ArithmeticError")
    assert "width 40" in d.error.message


def test_decode_one_inline_bytes(tmp_path: Path) -> None:
    name = png(tmp_path, "b.png", (6, 9))
    d = decode_one((tmp_path / name).read_bytes(), "", Preprocessors(image=ArrayPreprocessor()), MEDIA)
    assert d.error is None and d.value.pixels.shape == (9, 6, 3)


# -- ordering, errors, bookkeeping ------------------------------------------------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_results_of_every_chunk(tmp_path: Path, pools: list[DecodePool], workers: int) -> None:
    """Every chunk comes back once with its key (in submission order without workers)."""
    sizes = [(8, 5), (9, 6), (10, 7), (11, 8), (12, 9)]
    names = [png(tmp_path, f"i{i}.png", s, seed=i) for i, s in enumerate(sizes)]
    (tmp_path / "junk.jpg").write_bytes(b"\xff\xd8 definitely not a jpeg" * 4)
    base = str(tmp_path)
    chunks = {
        "c0": [(names[0], base), ("missing.png", base)],
        ("c", 1): [(names[1], base), ("junk.jpg", base), (names[2], base)],
        "c2": [(names[3], base)],
        3: [(names[4], base), (str(tmp_path / names[0]), "/elsewhere")],  # absolute paths ignore base_dir
    }
    pool = make_pool(pools, ArrayPreprocessor(), workers)
    for key, chunk in chunks.items():
        pool.submit(key, chunk)
    assert pool.in_flight == 8

    got = list(pool.drain())
    if workers == 0:
        assert [k for k, _ in got] == list(chunks)
    results = sorted(got, key=lambda kr: list(chunks).index(kr[0]))
    assert [k for k, _ in results] == list(chunks)
    assert [shapes(r) for _, r in results] == [
        [shape_of(sizes[0]), "media.not_found"],
        [shape_of(sizes[1]), "media.unreadable", shape_of(sizes[2])],
        [shape_of(sizes[3])],
        [shape_of(sizes[4]), shape_of(sizes[0])],
    ]
    errors = {d.error.reason: d.error for _, r in results for d in r if d.error is not None}
    assert errors["media.not_found"].code == 404
    assert errors["media.unreadable"].code == 400
    assert isinstance(errors["media.unreadable"], MMError)  # unpickled intact from a worker
    assert pool.in_flight == 0
    assert list(pool.drain()) == [] and list(pool.ready()) == []
    pids = {d.value.meta["pid"] for _, r in results for d in r if d.error is None}
    assert (pids == {os.getpid()}) == (workers == 0)


@pytest.mark.parametrize("workers", [0, 1])
def test_preprocessor_exception_in_pool(tmp_path: Path, pools: list[DecodePool], workers: int) -> None:
    narrow, wide = png(tmp_path, "n.png", (10, 10)), png(tmp_path, "w.png", (50, 10))
    pool = make_pool(pools, FailingPreprocessor(), workers)
    pool.submit("k", [(wide, str(tmp_path)), (narrow, str(tmp_path))])
    [(key, results)] = list(pool.drain())
    assert key == "k"
    assert results[0].value is None
    assert (results[0].error.stage, results[0].error.reason, results[0].error.error) == \
        ("preprocess", "preprocess.failed", "ArithmeticError")
    assert results[1].error is None and results[1].value.pixels.shape == (10, 10, 3)


def test_in_flight_and_full(tmp_path: Path, pools: list[DecodePool]) -> None:
    name = png(tmp_path, "a.png", (5, 5))
    item = (name, str(tmp_path))
    pool = make_pool(pools, ArrayPreprocessor(), workers=0, max_in_flight=5)
    assert pool.in_flight == 0 and not pool.full()
    pool.submit("a", [item, item])
    assert pool.in_flight == 2 and not pool.full()
    pool.submit("b", [item, item])
    assert pool.in_flight == 4 and not pool.full()
    pool.submit("c", [item])
    assert pool.in_flight == 5 and pool.full()

    gen = pool.ready()
    key, results = next(gen)
    assert key == "a" and len(results) == 2
    assert pool.in_flight == 3 and not pool.full()
    assert [k for k, _ in gen] == ["b", "c"]  # workers=0: everything is done at once
    assert pool.in_flight == 0


def test_max_in_flight_is_at_least_one(pools: list[DecodePool], tmp_path: Path) -> None:
    pool = make_pool(pools, ArrayPreprocessor(), workers=0, max_in_flight=0)
    assert pool.max_in_flight == 1 and not pool.full()
    pool.submit("a", [(png(tmp_path, "a.png", (3, 3)), str(tmp_path))])
    assert pool.full()


def test_ready_does_not_block_on_a_running_head_chunk(tmp_path: Path, pools: list[DecodePool]) -> None:
    """Not full: `ready()` yields nothing while the head chunk is still decoding; `drain()` waits."""
    name = png(tmp_path, "a.png", (7, 4))
    pool = make_pool(pools, SleepyPreprocessor(0.5), workers=1, max_in_flight=10)
    pool.submit("slow", [(name, str(tmp_path))])
    assert not pool.full()
    assert list(pool.ready()) == []
    assert pool.in_flight == 1  # nothing was taken

    [(key, results)] = list(pool.drain())
    assert key == "slow" and shapes(results) == [(4, 7, 3)]
    assert pool.in_flight == 0 and list(pool.ready()) == []


@dataclass
class SlowOnWide(ArrayPreprocessor):
    """Takes 2 s on images wider than 30 pixels (a URL at its timeout), no time on the others."""

    def __call__(self, image: Image.Image) -> ImageInput:
        if image.size[0] > 30:
            time.sleep(2.0)
        return super().__call__(image)


@pytest.mark.parametrize("collect", ["drain", "ready"])
def test_a_slow_chunk_never_holds_those_behind_it(tmp_path: Path, pools: list[DecodePool], collect: str) -> None:
    slow, fast = png(tmp_path, "slow.png", (40, 4)), png(tmp_path, "fast.png", (5, 4))
    pool = make_pool(pools, SlowOnWide(), workers=2, max_in_flight=4)
    pool.submit("slow", [(slow, str(tmp_path))])
    for key in ("f1", "f2", "f3"):
        pool.submit(key, [(fast, str(tmp_path))])
    assert pool.full()
    t0 = time.monotonic()
    first = next(pool.drain() if collect == "drain" else pool.ready())
    assert first[0] != "slow" and time.monotonic() - t0 < 1.5
    rest = [k for k, _ in pool.drain()]
    assert sorted([first[0], *rest]) == ["f1", "f2", "f3", "slow"] and rest[-1] == "slow"


def test_the_loop_does_its_own_work_before_waiting(tmp_path: Path, pools: list[DecodePool]) -> None:
    """`idle` (the encode loop's: account for the batch on the device) runs before each wait."""
    name = png(tmp_path, "a.png", (7, 4))
    calls: list[int] = []
    pool = DecodePool(Preprocessors(image=SleepyPreprocessor(0.3)), MEDIA, workers=1, max_in_flight=10,
                      idle=lambda: calls.append(pool.in_flight))
    pools.append(pool)
    pool.submit("x", [(name, str(tmp_path))])
    assert list(pool.ready()) == [] and calls == []  # not full: no wait, no call
    [(key, _)] = list(pool.drain())
    assert key == "x" and calls == [1]


def test_ready_blocks_for_the_head_chunk_when_full(tmp_path: Path, pools: list[DecodePool]) -> None:
    name = png(tmp_path, "a.png", (7, 4))
    pool = make_pool(pools, SleepyPreprocessor(0.3), workers=1, max_in_flight=2)
    pool.submit("x", [(name, str(tmp_path)), (name, str(tmp_path))])
    assert pool.full()
    gen = pool.ready()
    key, results = next(gen)  # blocks until decoded, since the pool is full
    assert key == "x" and shapes(results) == [(4, 7, 3), (4, 7, 3)]
    assert list(gen) == []
    assert pool.in_flight == 0


def test_ready_yields_every_finished_chunk(tmp_path: Path, pools: list[DecodePool]) -> None:
    """Polling `ready()` (never blocking: the pool is not full) eventually collects every chunk."""
    name = png(tmp_path, "a.png", (3, 2))
    pool = make_pool(pools, ArrayPreprocessor(), workers=2, max_in_flight=10)
    for key in range(4):
        pool.submit(key, [(name, str(tmp_path))])
    collected: list[Any] = []
    for _ in range(600):  # at most ~30 s; a few hundred ms in practice
        collected += [k for k, _ in pool.ready()]
        if len(collected) == 4:
            break
        time.sleep(0.05)
    assert sorted(collected) == [0, 1, 2, 3]
    assert pool.in_flight == 0


# -- a worker that dies -------------------------------------------------------------------------------

def test_worker_death_fails_only_the_guilty_item(tmp_path: Path, pools: list[DecodePool]) -> None:
    base = str(tmp_path)
    killer = png(tmp_path, "killer.png", KILLER_SIZE)
    good = [png(tmp_path, f"g{i}.png", (4 + i, 3 + i), seed=i) for i in range(5)]
    pool = make_pool(pools, ExitingPreprocessor(), workers=1)
    pool.submit("first", [(good[0], base), (killer, base), (good[1], base)])
    pool.submit("second", [(good[2], base), (good[3], base)])

    results = list(pool.drain())
    assert [k for k, _ in results] == ["first", "second"]
    first, second = results[0][1], results[1][1]
    assert shapes(first) == [(3, 4, 3), "internal", (4, 5, 3)]
    err = first[1].error
    assert first[1].value is None
    assert (err.code, err.reason, err.stage) == (500, "internal", "decode")
    assert "decode worker died" in err.message
    assert shapes(second) == [(5, 6, 3), (6, 7, 3)]

    # the pool was restarted: it keeps working for later submissions
    pool.submit("third", [(good[4], base)])
    [(key, third)] = list(pool.drain())
    assert key == "third" and shapes(third) == [(7, 8, 3)]


def test_worker_death_found_at_submit(tmp_path: Path, pools: list[DecodePool]) -> None:
    """A worker dies while nothing else is pending; the next submit restarts the broken pool."""
    base = str(tmp_path)
    killer = png(tmp_path, "killer.png", KILLER_SIZE)
    good = png(tmp_path, "good.png", (6, 5))
    pool = make_pool(pools, ExitingPreprocessor(), workers=1)
    pool.submit("k", [(killer, base)])
    [(key, results)] = list(pool.drain())
    assert key == "k" and shapes(results) == ["internal"]
    pool.submit("g", [(good, base)])
    [(key, results)] = list(pool.drain())
    assert key == "g" and shapes(results) == [(5, 6, 3)]


# -- an item past its deadline ----------------------------------------------------------------------

def test_an_item_past_its_deadline_fails_once_and_its_chunk_mates_are_decoded(tmp_path: Path,
                                                                              pools: list[DecodePool]) -> None:
    base = str(tmp_path)
    hang = png(tmp_path, "hang.png", (31, 5))
    good = [png(tmp_path, f"g{i}.png", (4 + i, 3 + i), seed=i) for i in range(2)]
    log = tmp_path / "hung.log"
    media = MediaConfig(decode_timeout=1.0, fetch_timeout=5.0, fetch_retries=0)
    pool = DecodePool(Preprocessors(image=HangingPreprocessor(log=str(log))), media, workers=1, max_in_flight=64)
    pools.append(pool)
    t0 = time.monotonic()
    pool.submit("chunk", [(good[0], base), (hang, base), (good[1], base)])
    [(key, results)] = list(pool.drain())
    seconds = time.monotonic() - t0
    assert key == "chunk" and shapes(results) == [(3, 4, 3), "media.timeout", (4, 5, 3)]
    err = results[1].error
    assert (err.code, err.stage) == (504, "decode") and "within 1 s" in err.message, err
    assert len(log.read_text().splitlines()) == 1  # never started a second time on its own
    assert seconds < 6  # one deadline of 1 s (a local file has no fetch budget), not two of 6 s

    pool.submit("after", [(good[1], base)])  # the replaced worker keeps working
    [(key, results)] = list(pool.drain())
    assert key == "after" and shapes(results) == [(4, 5, 3)]


def test_only_a_fetched_item_has_a_fetch_budget() -> None:
    media = MediaConfig(decode_timeout=5.0, fetch_timeout=20.0, fetch_retries=2)
    for local in ("a.png", "file:///x/a.png", "data:image/png;base64,AAAA", b"\x89PNG", ""):
        assert item_deadline(media, local, "/data") == 5.0, local
    fetched = item_deadline(media, "https://x.org/a.png", "/data")
    assert fetched > 3 * 20.0 + 5.0  # three attempts, the waits between them, the decode
    assert item_deadline(media, "s3://bucket/a.png", "") == fetched
    assert item_deadline(media, "a.png", "s3://bucket/clips") == fetched  # relative to a manifest in a store


# -- closing --------------------------------------------------------------------------------------------

def _pool_workers(before: set[int]) -> list[psutil.Process]:
    """Our descendants started since `before` that are not our direct children: the pool's workers
    (forked by the forkserver, which itself is a direct child shared by every pool)."""
    me = os.getpid()
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.ppid() != me]


def test_close_kill_leaves_no_worker_alive(tmp_path: Path, pools: list[DecodePool]) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    name = png(tmp_path, "a.png", (7, 4))
    pool = make_pool(pools, SleepyPreprocessor(60.0), workers=2, max_in_flight=10)
    pool.submit("busy-1", [(name, str(tmp_path))])  # still sleeping when the pool is killed
    pool.submit("busy-2", [(name, str(tmp_path))])
    workers: list[psutil.Process] = []
    for _ in range(200):  # wait (at most ~10 s) until both workers are up
        workers = _pool_workers(before)
        if len(workers) == 2:
            break
        time.sleep(0.05)
    assert len(workers) == 2, workers

    pool.close(kill=True)
    assert pool.in_flight == 0 and list(pool.drain()) == []
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert alive == [], [p.pid for p in alive]
    pool.close(kill=True)  # closing twice is harmless
