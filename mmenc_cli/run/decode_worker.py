"""The decode workers' side: one image source -> an `ImageInput` or its `MMError`.

Workers never touch torch or the GPU. Each runs `init_worker` once (Pillow's limits, a watch on
the encode process, the preprocessor, the shared-memory slots) and then `decode_chunk` per chunk
of images, each under its deadline; `decode_one` is the same work for one image, also run in the
encode process when `--workers 0`. The pool that drives them is `decode_pool.py`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..config import MediaConfig
from ..encoders.base import ImageInput, ImagePreprocessor
from ..errors import MMError, classify
from ..media import configure_pillow, load_encoded, load_image
from ..media.decode import decode_image, device_jpeg
from ..media.sources import guard
from .shm import Slot, SlotWriter

_STATE: dict[str, Any] = {}


@dataclass(slots=True)
class Decoded:
    """A worker's answer for one image: `value` or `error`, plus seconds per stage."""

    value: ImageInput | None
    error: MMError | None
    seconds: tuple[float, float]  # load + decode, preprocess
    slot: Slot | None = None  # where the pixels are, when they came in shared memory


def init_worker(preprocessor: ImagePreprocessor, media: MediaConfig, parent: int,
                 slots: tuple[str, int] | None = None) -> None:
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how to stop
    configure_pillow(media)  # per-process Pillow limits matching --max-image-pixels
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _STATE["pre"] = preprocessor
    _STATE["media"] = media
    _STATE["slots"] = SlotWriter(*slots) if slots is not None else None
    _STATE["devnull"] = open(os.devnull, "w")  # faulthandler's traceback of a timed-out item goes nowhere


def _watch_parent(pid: int) -> None:
    """Exit when the encode process is gone (e.g. SIGKILLed), so no worker outlives it.

    A killed parent stays a zombie until reaped, so a zombie counts as gone; once the workers
    exit, the forkserver and resource tracker (kept alive by the workers' fds) exit too.
    """
    while True:
        time.sleep(0.5)
        if _gone(pid):
            os._exit(1)


def _gone(pid: int) -> bool:
    """True when process `pid` has exited or is a zombie (psutil, else Linux's /proc)."""
    try:
        import psutil
    except ImportError:  # a bare GPU image without it: /proc says the same on Linux
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                return f.read().rpartition(")")[2].split()[0] == "Z"
        except FileNotFoundError:
            return True
        except (OSError, IndexError):
            return False
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def decode_one(source: str | bytes, base_dir: str, preprocessor: ImagePreprocessor, media: MediaConfig,
               cpu_only: bool = False) -> Decoded:
    """Load, decode and preprocess one image; every failure becomes an `MMError`. Under
    `--decode gpu` (unless `cpu_only`) a JPEG the device can decode stays encoded: its bytes go to
    the encode process as a 1-D uint8 `ImageInput` with `meta["jpeg"]`."""
    t0 = time.perf_counter()
    stage = "load"
    try:
        draft = preprocessor.draft_size if media.decode in ("fast", "gpu") else None
        if media.decode == "gpu" and not cpu_only:
            data, content_type = load_encoded(source, base_dir, media)
            if guard("decode", device_jpeg, data, media):
                return Decoded(ImageInput(np.frombuffer(data, dtype=np.uint8), {"jpeg": True}), None,
                               (time.perf_counter() - t0, 0.0))
            image = guard("decode", decode_image, data, media, content_type, draft)
        else:
            image = load_image(source, base_dir, media, draft=draft)  # raises MMError with its own stage
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


def decode_chunk(chunk: Sequence[tuple[str | bytes, str, int | None, bool]]) -> list[Decoded]:
    """In a worker: each item under its deadline; its uint8 pixels into its shared-memory slot
    when it has one. faulthandler's watchdog is a C thread, so it ends the process even when a
    library call hangs holding the GIL; the pool then isolates the item."""
    import faulthandler

    pre, media, slots = _STATE["pre"], _STATE["media"], _STATE.get("slots")
    out = []
    for src, base, slot, cpu_only in chunk:
        faulthandler.dump_traceback_later(item_deadline(media), exit=True, file=_STATE["devnull"])
        try:
            dec = decode_one(src, base, pre, media, cpu_only)
        finally:
            faulthandler.cancel_dump_traceback_later()
        if slot is not None and slots is not None and dec.value is not None:
            dec.slot = slots.write(slot, dec.value.pixels)
            if dec.slot is not None:
                dec.value.pixels = _IN_SLOT
        out.append(dec)
    return out


#: what `ImageInput.pixels` holds on its way back when the pixels are in a slot
_IN_SLOT = np.empty(0, dtype=np.uint8)
