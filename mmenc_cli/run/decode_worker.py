"""The decode workers' side: one media source -> an `ImageInput`, `AudioInput`, `VideoInput` or its `MMError`.

Workers never touch the GPU, nor torch unless the run's audio feature extractor or video processor
(transformers') imports it; then each worker's torch runs on one thread.
Each runs `init_worker` once (Pillow's limits, a watch on the encode process, the preprocessors,
the shared-memory slots) and then `decode_chunk` per chunk of items of one medium, each under its
deadline; `decode_one` is the same work for one item, also run in the encode process when
`--workers 0`. Images decode with Pillow, audio and video with PyAV (`media/`). The pool that
drives them is `decode_pool.py`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..config import DEFAULT_FRAMES, DEFAULT_MAX_INFLIGHT_BYTES, MediaConfig
from ..encoders.base import AudioInput, AudioPreprocessor, ImageInput, ImagePreprocessor, VideoInput
from ..errors import MMError, classify
from ..lifeline import inherit
from ..media import FetchAhead, Fetched, configure_pillow, fetch_ahead, load_clip, load_encoded, load_image, locate
from ..media.audio import decode_audio
from ..media.decode import decode_image, device_jpeg
from ..media.sources import guard
from ..media.video import decode_frames
from .board import BoardWriter
from .shm import Slot, SlotWriter

_STATE: dict[str, Any] = {}


@dataclass(frozen=True)
class Preprocessors:
    """What the workers need of the model: the image preprocessor, the audio one, the video one
    (None: each frame through the image preprocessor, a `VideoInput`), and how many frames a
    video clip gives (`frames`, resolved)."""

    image: ImagePreprocessor | None = None
    audio: AudioPreprocessor | None = None
    video: Callable[[list[Any]], Any] | None = None
    frames: int = DEFAULT_FRAMES


@dataclass(slots=True)
class Decoded:
    """A worker's answer for one item: `value` or `error`, plus seconds per stage."""

    value: ImageInput | AudioInput | VideoInput | None
    error: MMError | None
    seconds: tuple[float, float]  # load + decode, preprocess
    slot: Slot | None = None  # where the pixels are, when they came in shared memory
    frames: tuple[Slot | None, ...] = ()  # a video clip's: where each frame's pixels are (None: pickled)


def init_worker(preprocessors: Preprocessors, media: MediaConfig, parent: int,
                 slots: tuple[str, int] | None = None, board: tuple[str, int] | None = None,
                 fetch_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES) -> None:
    import importlib
    import signal
    import threading

    inherit()  # under an engine: dies with the forkserver, which dies with the encode process
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides how to stop
    configure_pillow(media)  # per-process Pillow limits matching --max-image-pixels
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _STATE["pre"] = preprocessors
    _STATE["media"] = media
    _STATE["fetch_bytes"] = fetch_bytes  # the bodies of S3 images fetched ahead and not yet decoded
    _STATE["slots"] = SlotWriter(*slots) if slots is not None else None
    _STATE["devnull"] = open(os.devnull, "w")  # faulthandler's traceback of a timed-out item goes nowhere
    if board is not None:
        try:
            _STATE["board"] = BoardWriter(*board)
        except OSError:  # the board gone (the pool closing): a timeout is then found by retrying the item alone
            pass
    if preprocessors.image is not None and preprocessors.image.imports_torch():
        importlib.import_module("torch")  # preloaded by the forkserver where it could be
    if "torch" in sys.modules:  # fast resizing, a feature extractor or a video processor: one thread each
        sys.modules["torch"].set_num_threads(1)


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


def decode_one(source: str | bytes | Fetched, base_dir: str, pre: Preprocessors, media: MediaConfig,
               cpu_only: bool = False, modality: str = "image") -> Decoded:
    """Load, decode and preprocess one item of `modality`; every failure becomes an `MMError`."""
    t0 = time.perf_counter()
    stage = "load"
    try:
        if modality == "image":
            found = _image(source, base_dir, pre, media, cpu_only)
            if isinstance(found, Decoded):
                return found
        else:
            found, facts = _clip(modality, source, base_dir, pre, media)
        stage, t1 = "preprocess", time.perf_counter()
        value: Any
        if modality == "image":
            value = pre.image(found)  # type: ignore[misc]
        elif modality == "audio" or pre.video is not None:
            value = (pre.audio if modality == "audio" else pre.video)(found)  # type: ignore[misc]
            value.meta.update(facts)
        else:
            value = VideoInput([pre.image(im) for im in found], facts)  # type: ignore[misc]
        return Decoded(value, None, (t1 - t0, time.perf_counter() - t1))
    except Exception as exc:  # one bad item never stops the run
        return Decoded(None, classify(exc, stage), (time.perf_counter() - t0, 0.0))


def _clip(modality: str, source: str | bytes, base_dir: str, pre: Preprocessors,
          media: MediaConfig) -> tuple[Any, dict[str, Any]]:
    """An audio clip's mono samples at the model's rate, or a video clip's sampled frames, and
    facts for the payload's `meta`: `cut` (longer than the limit, or than the model's audio
    window) and for video `frame_step`, the seconds between two sampled frames."""
    clip = load_clip(source, base_dir, media.limit_bytes(modality))
    if modality == "audio":
        assert pre.audio is not None
        limits = [s for s in (media.max_audio_seconds, pre.audio.window_seconds) if s is not None]
        samples, cut = guard("decode", decode_audio, clip, pre.audio.sample_rate, min(limits) if limits else None)
        return samples, {"cut": cut}
    sampled = guard("decode", decode_frames, clip, pre.frames, media.fps, media.max_video_seconds,
                    media.max_image_pixels)
    return sampled.images, {"cut": sampled.cut, "frame_step": sampled.step}


def _image(source: str | bytes | Fetched, base_dir: str, pre: Preprocessors, media: MediaConfig, cpu_only: bool) -> Any:
    """A decoded RGB image; under `--decode gpu` (unless `cpu_only`) a JPEG the device can decode
    stays encoded: a `Decoded` of its bytes as a 1-D uint8 `ImageInput` with `meta["jpeg"]`."""
    t0 = time.perf_counter()
    assert pre.image is not None
    draft = pre.image.draft_size if media.decode in ("fast", "gpu") else None
    if media.decode == "gpu" and not cpu_only:
        data, content_type = load_encoded(source, base_dir, media)
        if guard("decode", device_jpeg, data, media):
            return Decoded(ImageInput(np.frombuffer(data, dtype=np.uint8), {"jpeg": True}), None,
                           (time.perf_counter() - t0, 0.0))
        return guard("decode", decode_image, data, media, content_type, draft)
    return load_image(source, base_dir, media, draft=draft)  # raises MMError with its own stage


def decode_here(chunk: Sequence[tuple[str | bytes, str, bool]], pre: Preprocessors, media: MediaConfig,
                modality: str, fetch_bytes: int) -> list[Decoded]:
    """`decode_one` for each (source, base_dir, cpu_only) of a chunk in this process (`--workers 0`),
    its S3 images fetched ahead as in a worker."""
    ahead = fetch_ahead([(src, base) for src, base, _ in chunk] if modality == "image" else [], media, fetch_bytes)
    try:
        return [_decode_ahead(ahead, k, src, base, pre, media, cpu_only, modality)
                for k, (src, base, cpu_only) in enumerate(chunk)]
    finally:
        ahead.close()


def _decode_ahead(ahead: FetchAhead, position: int, source: str | bytes, base_dir: str, pre: Preprocessors,
                  media: MediaConfig, cpu_only: bool, modality: str) -> Decoded:
    """`decode_one` of the item at `position`, from its bytes when they were fetched ahead; the wait
    for them counts as loading."""
    if position not in ahead:
        return decode_one(source, base_dir, pre, media, cpu_only, modality)
    t0 = time.perf_counter()
    fetched = ahead.take(position)
    dec = decode_one(fetched, base_dir, pre, media, cpu_only, modality)
    dec.seconds = (time.perf_counter() - t0 - dec.seconds[1], dec.seconds[1])
    return dec


def item_deadline(media: MediaConfig, source: Any, base_dir: str) -> float:
    """Seconds one item may take in a worker: --decode-timeout for reading, decoding and
    preprocessing, plus, for an item fetched over the network (http(s), an object store), every
    fetch attempt and the waits between them. A local file or inline bytes fetch nothing, so
    their budget is --decode-timeout alone. A worker past it ends itself."""
    from ..media.http import BACKOFF_CAP_S, RETRY_AFTER_MAX_S

    if locate(source, base_dir)[0] in ("path", "inline"):
        return media.decode_timeout
    waits = media.fetch_retries * max(BACKOFF_CAP_S, RETRY_AFTER_MAX_S)
    return media.fetch_timeout * (1 + media.fetch_retries) + waits + media.decode_timeout


def decode_chunk(chunk: Sequence[tuple[str | bytes, str, Any, bool]], modality: str = "image",
                 token: int = 0) -> list[Decoded]:
    """In a worker: each item under its deadline; an image's uint8 pixels into its shared-memory
    slot when it has one, a video clip's frames into theirs (a tuple of slots per clip). faulthandler's watchdog is a C thread, so it ends the process even when
    a library call hangs holding the GIL; the pool then isolates the item. With a `token`, the
    board holds the item the worker is on (`board.Board.timed_out` reads it)."""
    pre, media = _STATE["pre"], _STATE["media"]
    ahead = fetch_ahead([(src, base) for src, base, _, _ in chunk] if modality == "image" else [], media,
                        _STATE.get("fetch_bytes", DEFAULT_MAX_INFLIGHT_BYTES))
    try:  # a chunk that ends early still wakes and ends its fetches (their threads serve the next chunk)
        return [_decode_in_slot(ahead, position, item, token, pre, media, modality)
                for position, item in enumerate(chunk)]
    finally:
        ahead.close()


def _decode_in_slot(ahead: FetchAhead, position: int, item: tuple[str | bytes, str, Any, bool], token: int,
                    pre: Preprocessors, media: MediaConfig, modality: str) -> Decoded:
    """One item of `decode_chunk`, under its deadline, into its shared-memory slot(s)."""
    import faulthandler

    src, base, slot, cpu_only = item
    slots = _STATE.get("slots")
    deadline = item_deadline(media, src, base)
    _record(token, token, position, time.monotonic(), deadline)
    faulthandler.dump_traceback_later(deadline, exit=True, file=_STATE["devnull"])
    try:  # an image fetched ahead is waited for under its deadline
        dec = _decode_ahead(ahead, position, src, base, pre, media, cpu_only, modality)
    finally:
        faulthandler.cancel_dump_traceback_later()
        _record(token, 0, 0, 0.0, 0.0)
    if isinstance(slot, tuple) and slots is not None and isinstance(dec.value, VideoInput):
        dec.frames = tuple(_to_slot(slots, index, frame) for index, frame in zip(slot, dec.value.frames))
    elif slot is not None and slots is not None and isinstance(dec.value, ImageInput):
        dec.slot = slots.write(slot, dec.value.pixels)
        if dec.slot is not None:
            dec.value.pixels = _IN_SLOT
    return dec


def _record(token: int, *fields: Any) -> None:
    """Overwrite the board's record of chunk `token` (kept only for chunks with a token)."""
    board = _STATE.get("board")
    if board is not None and token:
        board.write(token, *fields)


def _to_slot(slots: SlotWriter, index: int | None, frame: ImageInput) -> Slot | None:
    """A video frame's pixels into slot `index` (None: no slot, or they do not fit: pickled)."""
    written = slots.write(index, frame.pixels) if index is not None else None
    if written is not None:
        frame.pixels = _IN_SLOT
    return written


#: what `ImageInput.pixels` holds on its way back when the pixels are in a slot
_IN_SLOT = np.empty(0, dtype=np.uint8)
