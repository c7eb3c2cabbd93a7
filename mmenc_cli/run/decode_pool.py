"""Loading and preprocessing media in worker processes, with bounded prefetch in completion order.

Workers (`decode_worker.py`) never touch the GPU: they turn an image, audio or video source into
its payload (an image's compact uint8 pixels where the model's processor allows) or an `MMError`,
and report seconds spent loading, decoding and preprocessing. A chunk holds items of one medium.
The parent keeps at most `max_in_flight` items submitted (a video clip counts as its frames),
so memory stays bounded however large the manifest is, and takes results as they finish: a
slow image (a URL at its timeout) never holds the images decoded after it. A worker asks for all
the S3 images of its chunk at once (`media/ahead.py`), their bodies within its share of
`--max-inflight-bytes` (`fetch_bytes`), and decodes each as it arrives, in order.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import multiprocessing as mp
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterator, Sequence

from ..config import DEFAULT_MAX_INFLIGHT_BYTES, MediaConfig, RunConfig
from ..errors import MMError
from ..encoders.base import VideoInput
from .decode_worker import (
    Decoded,
    Preprocessors,
    decode_chunk,
    decode_here,
    init_worker,
    item_deadline,
)
from .board import Board
from .shm import SlotPool, shm_slots

log = logging.getLogger("mmenc")

#: the most images the device refused that go back to the workers as one chunk: a batch's refused
#: JPEGs (a corrupt file, a format nvJPEG does not take) are shared by the workers, not one worker's
REFUSED_CHUNK = 4

class _Done:
    """A completed future stand-in for in-process decoding (workers=0)."""

    def __init__(self, value: list[Decoded]) -> None:
        self._value = value

    def result(self) -> list[Decoded]:
        return self._value


def start_forkserver(torch: bool) -> None:
    """Start the process the decode workers fork from, importing what they need first (with `torch`,
    torch: `--decode fast` resizes with it), once for all of them. Started while the model loads, its
    imports (a second or two for torch) cost no time; a forkserver already running stays as it is."""
    import multiprocessing.forkserver

    preload = ["mmenc_cli.lifeline_preload", "mmenc_cli.run.decode_worker", "mmenc_cli.media", "numpy", "PIL.Image"]
    mp.get_context("forkserver").set_forkserver_preload(preload + (["torch"] if torch else []))
    multiprocessing.forkserver.ensure_running()


def workers_start_early(cfg: RunConfig, device: str) -> bool:
    """True when the decode workers' forkserver should start before the model loads (preloading
    torch for `--decode fast`'s resize, so its imports overlap the load instead of delaying the
    first batch): images asked for, or on a GPU the model's towers not yet known. A text-only run
    on the CPU never starts it."""
    asked = cfg.modalities is not None and bool({"image", "video"} & set(cfg.modalities))
    maybe = cfg.modalities is None and device.startswith("cuda")
    return (asked or maybe) and cfg.media.decode in ("fast", "gpu") \
        and cfg.batch.workers_per_device(len(cfg.model.devices)) > 0


class DecodePool:
    """Bounded decoding: `submit(key, chunk)` then iterate `ready()` / `drain()`; results come in
    completion order (with `workers=0`, in submission order).

    `workers=0` decodes in the calling process (for tests and tiny runs).
    """

    def __init__(self, preprocessors: Preprocessors, media: MediaConfig, workers: int, max_in_flight: int,
                 stop: Any = None, slots: int = 0, idle: Callable[[], None] | None = None,
                 fetch_bytes: int | None = None) -> None:
        self.stop = stop  # the run's stop Event: a pool broken while stopping drops its chunks (no error rows)
        self.idle = idle  # called before waiting for a result: the encode loop finishes its own work first
        self.preprocessors = preprocessors
        self.media = media
        self.workers = workers
        self.max_in_flight = max(1, max_in_flight)
        #: each worker's S3 image bodies fetched ahead and not yet decoded (`media/ahead.py`)
        self.fetch_bytes = fetch_bytes if fetch_bytes is not None else DEFAULT_MAX_INFLIGHT_BYTES // max(1, workers)
        self._pending: collections.deque[tuple[Any, list, Any, Any, str, int]] = collections.deque()
        self._tokens = itertools.count(1)  # names a chunk on the workers' board
        self._ended: dict[int, float] = {}  # when each chunk's future finished (a broken pool: when it broke)
        self.board: Board | None = None  # where workers record the item they are on
        self._finished: collections.deque[bool] = collections.deque()  # a chunk finished since the last look
        self._in_flight = 0
        self._ex: ProcessPoolExecutor | None = None
        #: shared-memory slots for `slots` images (in flight and waiting for their batch)
        image = preprocessors.image
        self.slots: SlotPool | None = shm_slots(slots, image.max_pixel_bytes()) \
            if workers > 0 and image is not None else None
        if workers > 0:
            self.board = Board(self.max_in_flight + 4 * workers + 16)  # more slots than chunks in flight
            start_forkserver(torch=image is not None and image.imports_torch())
            self._ex = self._executor()

    def _executor(self) -> ProcessPoolExecutor:
        slots = (self.slots.name, self.slots.slot_bytes) if self.slots is not None else None
        return ProcessPoolExecutor(self.workers, mp_context=mp.get_context("forkserver"), initializer=init_worker,
                                   initargs=(self.preprocessors, self.media, os.getpid(), slots,
                                             self.board.address if self.board is not None else None,
                                             self.fetch_bytes))

    @property
    def in_flight(self) -> int:
        """Items submitted and not yet returned by `ready`/`drain` (a video clip counts as its frames)."""
        return self._in_flight

    def full(self) -> bool:
        """True when no more items should be submitted before collecting results."""
        return self._in_flight >= self.max_in_flight

    def submit(self, key: Any, sources: Sequence[tuple[str | bytes, str]], cpu_only: bool = False,
               modality: str = "image") -> None:
        """Queue a chunk of (source, base_dir) of one medium; `key` comes back with its results.
        `cpu_only`: decoded on the CPU whatever `--decode` says (images the device decoder refused)."""
        chunk = [(src, base, self._take(modality), cpu_only) for src, base in sources]
        token = next(self._tokens)
        if self._ex is None:
            fut: Any = _Done(decode_here([(s, b, c) for s, b, _, c in chunk], self.preprocessors, self.media,
                                         modality, self.fetch_bytes))
        else:
            try:
                fut = self._ex.submit(decode_chunk, chunk, modality, token)
            except BrokenProcessPool:  # a worker died since the last collect: the pool is unusable
                self._restart()
                fut = self._ex.submit(decode_chunk, chunk, modality, token)
        self._pending.append((key, chunk, fut, self._ex, modality, token))
        self._in_flight += self._weight(chunk, modality)
        if isinstance(fut, Future):  # runs on the executor's thread, or here if done
            fut.add_done_callback(functools.partial(self._on_finished, token))
        else:
            self._finished.append(True)

    def spread(self, items: list[Any]) -> list[list[Any]]:
        """`items` (images the device refused) cut into chunks the workers share: at most
        `REFUSED_CHUNK` each, and as many as there are workers while there are enough items
        (each chunk goes to whichever worker is free first)."""
        size = max(1, min(REFUSED_CHUNK, -(-len(items) // max(1, self.workers))))
        return [items[k:k + size] for k in range(0, len(items), size)]

    def _take(self, modality: str) -> Any:
        """Shared-memory slots for one item: an image's (or None), a video clip's frames' (a tuple,
        for the frames of a pooled image model; a VL model's patches travel pickled)."""
        if self.slots is None or modality == "audio" or (modality == "video" and self.preprocessors.video is not None):
            return None
        if modality == "video":
            return tuple(self.slots.acquire() for _ in range(self.preprocessors.frames))
        return self.slots.acquire()

    def _weight(self, chunk: list[Any], modality: str) -> int:
        """What a chunk counts against `max_in_flight`: its items, a video clip as its frames."""
        return len(chunk) * (self.preprocessors.frames if modality == "video" else 1)

    def _on_finished(self, token: int, _fut: Any) -> None:
        self._ended[token] = time.monotonic()  # one key per chunk, set once: safe from another thread
        self._finished.append(True)  # deque.append: safe from another thread

    def _pop(self, index: int = 0) -> tuple[Any, list[Decoded] | None]:
        """The results of the `index`-th pending chunk (waiting for them); None when the run stops
        first (the chunk is then neither encoded nor an error: not attempted)."""
        key, chunk, fut, ex, modality, token = self._pending[index]
        del self._pending[index]
        self._in_flight -= self._weight(chunk, modality)
        if not self._wait(fut):
            self._ended.pop(token, None)
            return key, None
        ended = self._ended.pop(token, time.monotonic())
        try:
            return key, self._received(chunk, fut.result())
        except BrokenProcessPool:  # a worker died: every chunk of that pool failed, most of them innocent
            if ex is self._ex:
                self._restart()
            if self._stopping():  # SIGTERM to the whole group killed workers or the forkserver
                return key, None
            late = self.board.timed_out(token, ended) if self.board is not None else set()
            isolated = self._isolate(chunk, modality, late)
            return key, None if isolated is None else self._received(chunk, isolated)

    def _received(self, chunk: list[tuple[Any, str, int | None, bool]], results: list[Decoded]) -> list[Decoded]:
        """Pixels that came in a slot are read there (the slot is freed by `release`, once their
        batch is copied out); the slots of the other items are freed now."""
        for (_src, _base, slot, _cpu), dec in zip(chunk, results):
            if isinstance(slot, tuple):
                self._received_frames(slot, dec)
            elif dec.slot is not None and dec.value is not None and self.slots is not None:
                dec.value.pixels = self.slots.view(dec.slot)
            elif self.slots is not None:
                self.slots.release(slot)
        return results

    def _received_frames(self, indices: tuple[int | None, ...], dec: Decoded) -> None:
        """A video clip's frames that came in slots are read there; the clip's other slots are freed."""
        assert self.slots is not None
        frames = dec.value.frames if isinstance(dec.value, VideoInput) else []
        kept = dec.frames if dec.value is not None else ()
        for k, index in enumerate(indices):
            written = kept[k] if k < len(kept) else None
            if written is not None:
                frames[k].pixels = self.slots.view(written)
            else:
                self.slots.release(index)

    def release(self, decoded: Decoded) -> None:
        """Free the slots of an item whose pixels have been copied out (a no-op without any)."""
        if self.slots is None:
            return
        if decoded.slot is not None:
            self.slots.release(decoded.slot.index)
            decoded.slot = None
        for written in decoded.frames:
            if written is not None:
                self.slots.release(written.index)
        decoded.frames = ()

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

    def _isolate(self, chunk: list[Any], modality: str, late: set[int]) -> list[Decoded] | None:
        """Decode each item of a chunk alone in a fresh pool: only an item that kills a worker by itself
        fails. An item that ran past its deadline in the chunk (`late`, by position) fails at once as
        504: decoding it again would cost a second deadline for the same answer."""
        out = []
        for position, item in enumerate(chunk):
            if position in late:
                deadline = item_deadline(self.media, item[0], item[1])
                out.append(Decoded(None, self._death(deadline, deadline, None), (0.0, 0.0)))
                continue
            dec = self._alone(item, modality)
            if dec is None:
                return None
            out.append(dec)
        return out

    def _alone(self, item: Any, modality: str) -> Decoded | None:
        """One item by itself. The pool can also break under it because another chunk's worker died:
        an item is blamed only when it breaks the pool twice (or runs past its deadline once)."""
        for attempt in (1, 2):
            t0 = time.monotonic()
            try:
                fut = self._ex.submit(decode_chunk, [item], modality)
            except BrokenProcessPool:  # broken by another chunk since: a fresh pool
                self._restart()
                fut = self._ex.submit(decode_chunk, [item], modality)
            if not self._wait(fut):
                return None
            try:
                return fut.result()[0]
            except BrokenProcessPool as exc:
                self._restart()
                if self._stopping():
                    return None
                seconds = time.monotonic() - t0
                deadline = item_deadline(self.media, item[0], item[1])
                if attempt == 2 or seconds >= deadline:
                    return Decoded(None, self._death(seconds, deadline, exc), (0.0, 0.0))
        return None  # pragma: no cover - the loop returns

    def _death(self, seconds: float, deadline: float, exc: BaseException | None) -> MMError:
        """The error of an item that ended its worker: by passing its deadline, or by crashing it."""
        if seconds >= deadline:
            limits = "--decode-timeout" if deadline == self.media.decode_timeout else "--decode-timeout and fetch limits"
            return MMError(f"loading and decoding this item did not finish within {deadline:g} s (its {limits}); "
                           "its worker was replaced", stage="decode", reason="media.timeout", error="TimeoutError")
        return MMError(f"decode worker died on this item: {exc}", stage="decode", reason="internal",
                       error=type(exc).__name__)

    def ready(self) -> Iterator[tuple[Any, list[Decoded] | None]]:
        """Results of finished chunks in completion order (the oldest first among those done),
        never blocking while the pool has room; when it is full, waits for whichever finishes
        first, so one slow fetch never holds the rest of the run."""
        while self._pending:
            index = self._first_done()
            if index is None:
                if not self.full():
                    return
                index = self._next()
                if index is None:
                    return
            yield self._pop(index)

    def drain(self) -> Iterator[tuple[Any, list[Decoded] | None]]:
        """All remaining results, in completion order (blocks); stops early at a stop request,
        leaving the rest in flight (the run counts it as not attempted)."""
        while self._pending:
            index = self._next()
            if index is None:
                return
            yield self._pop(index)

    def _next(self) -> int | None:
        """The first chunk to finish (waiting for it); None at a stop request."""
        idle = self.idle
        while True:
            index = self._first_done()
            if index is not None:
                return index
            if self.stop is not None and self.stop.is_set():
                return None
            if idle is not None:  # once per wait, and look again: it may have taken a while
                idle()
                idle = None
                continue
            wait([p[2] for p in self._pending if isinstance(p[2], Future)], timeout=0.25,
                 return_when=FIRST_COMPLETED)

    def _first_done(self) -> int | None:
        """The oldest finished chunk. Looks only when a chunk has finished since the last look
        found none (the encode loop asks once per row: scanning every time costs more than
        handling the row)."""
        if not self._finished:
            return None
        self._finished.clear()  # before the scan: a chunk finishing during it sets it again
        index = next((i for i in range(len(self._pending)) if self._done(i)), None)
        if index is not None:
            self._finished.append(True)  # others may be done too
        return index

    def _done(self, index: int) -> bool:
        fut = self._pending[index][2]
        return not isinstance(fut, Future) or fut.done()

    def _restart(self) -> None:
        if self._ex is not None:
            self._ex.shutdown(wait=False, cancel_futures=True)
            self._ex = self._executor()

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
        self._ended.clear()
        self._in_flight = 0
        self._ex = None
        if self.board is not None:
            self.board.close()
            self.board = None
        if self.slots is not None:
            self.slots.close()
            self.slots = None
