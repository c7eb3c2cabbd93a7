"""Loading and preprocessing images in worker processes, with bounded, ordered prefetch.

Workers never touch torch or the GPU: they turn an image source into an `ImageInput` (compact
uint8 pixels where the model's processor allows) or an `MMError`, and report seconds spent
loading, decoding and preprocessing. The parent keeps at most `max_in_flight` items submitted,
so memory stays bounded however large the manifest is, and reads results in submission order.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..config import MediaConfig
from ..encoders.base import ImageInput, ImagePreprocessor
from ..errors import MMError, classify
from ..media import configure_pillow, load_image

log = logging.getLogger("mmenc")

_STATE: dict[str, Any] = {}
#: seconds the oldest chunk is waited for before finished chunks behind it are taken first
PATIENCE_S = 2.0


@dataclass(slots=True)
class Decoded:
    """A worker's answer for one image: `value` or `error`, plus seconds per stage."""

    value: ImageInput | None
    error: MMError | None
    seconds: tuple[float, float]  # load + decode, preprocess


def _init_worker(preprocessor: ImagePreprocessor, media: MediaConfig, parent: int) -> None:
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how to stop
    configure_pillow(media)  # per-process Pillow limits matching --max-image-pixels
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _STATE["pre"] = preprocessor
    _STATE["media"] = media
    _STATE["devnull"] = open(os.devnull, "w")  # faulthandler's traceback of a timed-out item goes nowhere


def _watch_parent(pid: int) -> None:
    """Exit when the encode process is gone (e.g. SIGKILLed), so no worker outlives it.

    A killed parent stays a zombie until reaped, so a zombie counts as gone; once the workers
    exit, the forkserver and resource tracker (kept alive by the workers' fds) exit too.
    """
    import os

    import psutil

    while True:
        time.sleep(0.5)
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                os._exit(1)
        except psutil.NoSuchProcess:
            os._exit(1)
        except psutil.Error:
            pass


def decode_one(source: str | bytes, base_dir: str, preprocessor: ImagePreprocessor, media: MediaConfig) -> Decoded:
    """Load, decode and preprocess one image; every failure becomes an `MMError`."""
    t0 = time.perf_counter()
    stage = "load"
    try:
        image = load_image(source, base_dir, media)  # raises MMError with its own stage
        t1 = time.perf_counter()
        stage = "preprocess"
        value = preprocessor(image)
        return Decoded(value, None, (t1 - t0, time.perf_counter() - t1))
    except Exception as exc:  # one bad image never stops the run
        return Decoded(None, classify(exc, stage), (time.perf_counter() - t0, 0.0))


def item_deadline(media: MediaConfig) -> float:
    """Seconds one image may take in a worker: every fetch attempt, the waits between them, and
    --decode-timeout for reading, decoding and preprocessing. A worker past it ends itself."""
    from ..media.http import BACKOFF_CAP_S, RETRY_AFTER_MAX_S

    waits = media.fetch_retries * max(BACKOFF_CAP_S, RETRY_AFTER_MAX_S)
    return media.fetch_timeout * (1 + media.fetch_retries) + waits + media.decode_timeout


def _decode_chunk(chunk: Sequence[tuple[str | bytes, str]]) -> list[Decoded]:
    """In a worker: each item under its deadline. faulthandler's watchdog is a C thread, so it ends
    the process even when a library call hangs holding the GIL; the pool then isolates the item."""
    import faulthandler

    pre, media = _STATE["pre"], _STATE["media"]
    out = []
    for src, base in chunk:
        faulthandler.dump_traceback_later(item_deadline(media), exit=True, file=_STATE["devnull"])
        try:
            out.append(decode_one(src, base, pre, media))
        finally:
            faulthandler.cancel_dump_traceback_later()
    return out


class _Done:
    """A completed future stand-in for in-process decoding (workers=0)."""

    def __init__(self, value: list[Decoded]) -> None:
        self._value = value

    def result(self) -> list[Decoded]:
        return self._value


class DecodePool:
    """Bounded decoding: `submit(key, chunk)` then iterate `ready()` / `drain()`; results come in
    submission order unless the oldest chunk stalls (`_next`).

    `workers=0` decodes in the calling process (for tests and tiny runs).
    """

    def __init__(self, preprocessor: ImagePreprocessor, media: MediaConfig, workers: int, max_in_flight: int,
                 stop: Any = None) -> None:
        self.stop = stop  # the run's stop Event: a pool broken while stopping drops its chunks (no error rows)
        self.preprocessor = preprocessor
        self.media = media
        self.workers = workers
        self.max_in_flight = max(1, max_in_flight)
        self._pending: collections.deque[tuple[Any, list, Any, Any]] = collections.deque()
        self._in_flight = 0
        self._ex: ProcessPoolExecutor | None = None
        if workers > 0:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["mmenc_cli.run.decode_pool", "mmenc_cli.media", "numpy", "PIL.Image"])
            self._ex = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                           initargs=(preprocessor, media, os.getpid()))

    @property
    def in_flight(self) -> int:
        """Items submitted and not yet returned by `ready`/`drain`."""
        return self._in_flight

    def full(self) -> bool:
        """True when no more items should be submitted before collecting results."""
        return self._in_flight >= self.max_in_flight

    def submit(self, key: Any, chunk: Sequence[tuple[str | bytes, str]]) -> None:
        """Queue a chunk of (source, base_dir); `key` comes back with its results."""
        chunk = list(chunk)
        if self._ex is None:
            fut: Any = _Done([decode_one(s, b, self.preprocessor, self.media) for s, b in chunk])
        else:
            try:
                fut = self._ex.submit(_decode_chunk, chunk)
            except BrokenProcessPool:  # a worker died since the last collect: the pool is unusable
                self._restart()
                fut = self._ex.submit(_decode_chunk, chunk)
        self._pending.append((key, chunk, fut, self._ex))
        self._in_flight += len(chunk)

    def _pop(self, index: int = 0) -> tuple[Any, list[Decoded] | None]:
        """The results of the `index`-th pending chunk (waiting for them); None when the run stops
        first (the chunk is then neither encoded nor an error: not attempted)."""
        key, chunk, fut, ex = self._pending[index]
        del self._pending[index]
        self._in_flight -= len(chunk)
        if not self._wait(fut):
            return key, None
        try:
            return key, fut.result()
        except BrokenProcessPool:  # a worker died: every chunk of that pool failed, most of them innocent
            if ex is self._ex:
                self._restart()
            if self._stopping():  # SIGTERM to the whole group killed workers or the forkserver
                return key, None
            return key, self._isolate(chunk)

    def _wait(self, fut: Any) -> bool:
        """Wait for `fut`, looking at the stop request twice a second; False when it came first."""
        while isinstance(fut, Future) and not fut.done():
            if self.stop is not None and self.stop.is_set():
                return False
            wait([fut], timeout=0.5)
        return True

    def _stopping(self) -> bool:
        # wait briefly: the main thread's own signal handler runs during this wait
        return self.stop is not None and self.stop.wait(0.5)

    def _isolate(self, chunk: list[tuple[str | bytes, str]]) -> list[Decoded] | None:
        """Decode each item of a chunk alone in a fresh pool: only an item that kills a worker by itself fails."""
        out = []
        for item in chunk:
            t0 = time.monotonic()
            fut = self._ex.submit(_decode_chunk, [item])
            if not self._wait(fut):
                return None
            try:
                out.append(fut.result()[0])
            except BrokenProcessPool as exc:
                self._restart()
                if self._stopping():
                    return None
                out.append(Decoded(None, self._death(time.monotonic() - t0, exc), (0.0, 0.0)))
        return out

    def _death(self, seconds: float, exc: BaseException) -> MMError:
        """The error of an item that ended its worker: by passing its deadline, or by crashing it."""
        deadline = item_deadline(self.media)
        if seconds >= deadline:
            return MMError(f"loading and decoding this image did not finish within {deadline:g} s (the "
                           "--decode-timeout and fetch limits); its worker was replaced", stage="decode",
                           reason="media.timeout", error="TimeoutError")
        return MMError(f"decode worker died on this item: {exc}", stage="decode", reason="internal",
                       error=type(exc).__name__)

    def ready(self) -> Iterator[tuple[Any, list[Decoded] | None]]:
        """Results of finished chunks, in submission order, never blocking while the pool has room;
        when it is full, waits for the oldest chunk (see `_next`)."""
        while self._pending:
            if self._done(0):
                yield self._pop(0)
                continue
            if not self.full():
                return
            index = self._next()
            if index is None:
                return
            yield self._pop(index)

    def drain(self) -> Iterator[tuple[Any, list[Decoded] | None]]:
        """All remaining results (blocks); stops early at a stop request, leaving the rest in
        flight (the run counts it as not attempted)."""
        while self._pending:
            index = self._next()
            if index is None:
                return
            yield self._pop(index)

    def _next(self) -> int | None:
        """The chunk to return next: the oldest one, waited for up to `PATIENCE_S`; after that the
        oldest finished one behind it (a slow fetch does not hold the rest of the run); None at a
        stop request."""
        t0 = time.monotonic()
        while True:
            if self._done(0):
                return 0
            patient = time.monotonic() - t0 < PATIENCE_S
            if not patient:
                later = next((i for i in range(1, len(self._pending)) if self._done(i)), None)
                if later is not None:
                    return later
            if self.stop is not None and self.stop.is_set():
                return None
            futures = [self._pending[0][2]] if patient else [p[2] for p in self._pending]
            wait([f for f in futures if isinstance(f, Future)], timeout=0.25, return_when=FIRST_COMPLETED)

    def _done(self, index: int) -> bool:
        fut = self._pending[index][2]
        return not isinstance(fut, Future) or fut.done()

    def _restart(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=False, cancel_futures=True)
            ctx = mp.get_context("forkserver")
            self._ex = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                           initargs=(self.preprocessor, self.media, os.getpid()))

    def close(self, kill: bool = False) -> None:
        """Stop the workers; with `kill`, terminate them at once (signals) and drop pending work."""
        if self._ex is None:
            return
        procs = list(getattr(self._ex, "_processes", {}).values())
        self._ex.shutdown(wait=not kill, cancel_futures=True)
        if kill:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=5)
        self._pending.clear()
        self._in_flight = 0
        self._ex = None
