"""Text windows: texts gathered, tokenized once per window, sorted by length, cut into batches.

Texts are collected in windows of `TEXT_WINDOW`; a window is tokenized once without padding (the
encoder's `text_pretokenizer`) and sorted by token count, so each batch only pads (tokens computed
/ real tokens on the benchmark corpus, batches of 32: windows of 4096 1.036, 8192 1.024, 16384
~1.01; sentence-transformers' sort of all texts by characters 1.109). The texts of a window that
do not fill a batch carry over to the next. On an accelerator the next window is tokenized on a
background thread while the current one is encoded (`tokenize_ahead`), which holds one more window
of texts in memory. Memory is bounded by the window size, however long the manifest.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

from ..encoders.base import Encoder
from ..records import Item
from .counters import Counters
from ..stopping import interruptible

log = logging.getLogger("mmenc")

#: texts collected before they are sorted by length and cut into batches
TEXT_WINDOW = 16384

Pretokenize = Callable[[Sequence[str]], list[Any]]
Window = list[tuple[Item, Any]]  # (item, text or tokenized text)


def tokenize_ahead(device: str) -> bool:
    """Whether the next window of texts is tokenized on a background thread while the current
    one is encoded: on an accelerator, whose forward leaves the CPU cores idle; not on the CPU,
    where the forward's streams already keep every core busy. `MMENC_TOKENIZE_AHEAD=1|0` forces it."""
    want = os.environ.get("MMENC_TOKENIZE_AHEAD", "").strip()
    if want in ("0", "1"):
        return want == "1"
    return not str(device).startswith("cpu")


def pretokenize_window(window: Window, pretokenize: Pretokenize | None) -> float:
    """Tokenize a window's texts in place (without padding); return the seconds it took. Without a
    `pretokenize` (or when it fails) the window keeps its strings and is bucketed by characters."""
    t0 = time.perf_counter()
    if pretokenize is not None:
        raw = [i for i, (_, t) in enumerate(window) if isinstance(t, str)]
        try:
            tokens = pretokenize([window[i][1] for i in raw]) if raw else []
        except Exception as exc:  # e.g. one odd text: keep the strings, batches bisect to it
            log.info("pretokenizing %d texts failed (%s: %s): bucketing by characters",
                     len(raw), type(exc).__name__, exc)
            tokens = []
        for i, tok in zip(raw, tokens):
            window[i] = (window[i][0], tok)
    return time.perf_counter() - t0


class TextFeed:
    """Texts from `add` to `encode(items, payloads)` calls of at most 4 batches, sorted by length.

    Runs on the encode loop's thread; only the tokenizing of a window may run on another thread,
    which returns its seconds to be counted here.
    """

    def __init__(self, encoder: Encoder, batch_size: int, counters: Counters,
                 encode: Callable[[list[Item], list[Any]], None], stop: threading.Event) -> None:
        self.batch_size, self.counters, self.encode, self.stop = batch_size, counters, encode, stop
        self.stopped = stop.is_set
        self.texts: Window = []  # waiting for their window to fill
        # windows cut and being (or done) tokenized, oldest first, each with its tokenize job (a
        # future when tokenized ahead, else its seconds)
        self.windows: collections.deque[tuple[Window, Future[float] | float]] = collections.deque()
        self.carry: Window = []  # sorted texts that did not fill a batch
        self.todo: Window = []  # the window's sorted texts not yet handed to `encode`
        self.ahead: ThreadPoolExecutor | None = None
        if tokenize_ahead(encoder.device) and (ahead := encoder.text_pretokenizer(other_thread=True)):
            self.pretokenize: Pretokenize | None = ahead
            self.ahead = ThreadPoolExecutor(1, thread_name_prefix="mmenc-tokenize")
        else:
            self.pretokenize = encoder.text_pretokenizer(other_thread=False)

    def add(self, item: Item, text: str) -> None:
        """Accept one text (prefix already applied)."""
        self.texts.append((item, text))

    def pump(self) -> None:
        """Cut a full window; encode the windows before the one tokenizing ahead."""
        if len(self.texts) >= max(TEXT_WINDOW, self.batch_size * 8):
            self._cut_window()
            while len(self.windows) > (1 if self.ahead is not None else 0) and not self.stopped():
                self._encode_window(final=False)

    def finish(self) -> None:
        """Encode every text left (the last batch may be short)."""
        if self.texts:
            self._cut_window()
        while self.windows and not self.stopped():
            self._encode_window(final=len(self.windows) == 1)
        if self.carry and not self.stopped():
            self._encode_window(final=True)

    def drop(self) -> dict[str, int]:
        """Give up the texts not encoded (the run stops as a whole); return how many."""
        self.close()
        dropped = len(self.texts) + len(self.carry) + len(self.todo) + sum(len(w) for w, _ in self.windows)
        self.texts, self.carry, self.todo = [], [], []
        self.windows.clear()
        return {"text": dropped}

    def close(self) -> None:
        """Stop the tokenize-ahead thread (waiting for the window it is on)."""
        if self.ahead is not None:
            self.ahead.shutdown(wait=True, cancel_futures=True)
            self.ahead = None

    def _cut_window(self) -> None:
        window, self.texts = self.texts, []
        if self.ahead is not None:
            self.windows.append((window, self.ahead.submit(pretokenize_window, window, self.pretokenize)))
            return
        self.windows.append((window, 0.0))  # first: a stop while tokenizing leaves it to `drop`
        with interruptible(self.stop):
            self.windows[-1] = (window, pretokenize_window(window, self.pretokenize))

    def _encode_window(self, final: bool) -> None:
        """Encode the oldest window (with the texts carried over) in full batches sorted by length;
        what does not fill a batch carries over, unless `final`."""
        window, job = self.windows.popleft() if self.windows else ([], 0.0)
        self.counters.add_seconds("tokenize", job if isinstance(job, float) else job.result())
        # a batch holds one kind of payload, strings or tokenized texts
        texts, self.carry = self.carry + window, []
        texts.sort(key=lambda t: (not isinstance(t[1], str), len(t[1])))
        bs = self.batch_size
        cut = len(texts) if final else (len(texts) // bs) * bs
        self.todo, self.carry = texts[:cut], texts[cut:]
        while self.todo and not self.stopped():  # what a stop leaves is not attempted (`drop` counts it)
            part, self.todo = self.todo[:bs * 4], self.todo[bs * 4:]
            self.encode([p[0] for p in part], [p[1] for p in part])
