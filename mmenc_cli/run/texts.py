"""Text windows: texts gathered, tokenized once per window, sorted by length, cut into batches.

Texts are collected in windows of `TEXT_WINDOW`; a window is tokenized once without padding (the
encoder's `text_pretokenizer`) and sorted by token count, so each batch only pads (tokens computed
/ real tokens on the benchmark corpus, batches of 32: windows of 4096 1.036, 8192 1.024, 16384
~1.01; sentence-transformers' sort of all texts by characters 1.109). The texts of a window that
do not fill a batch carry over to the next. The next window is tokenized on a background thread
while the current one is encoded (`tokenize_ahead`), which holds one more window of texts in
memory. Memory is bounded by the window size, however long the manifest.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..encoders.base import Encoder
from ..encoders.tokens import TokenizedTexts
from ..records import Item
from ..stopping import interruptible
from .counters import Counters

log = logging.getLogger("mmenc")

#: texts collected before they are sorted by length and cut into batches
TEXT_WINDOW = 16384

Pretokenize = Callable[[Sequence[str]], Any]  # -> TokenizedTexts, or a list of per-text payloads
Payloads = list[Any] | TokenizedTexts


def tokenize_ahead(device: str) -> bool:
    """Whether the next window of texts is tokenized on a background thread while the current
    one is encoded: yes on every device. The tokenizer's batch calls leave the GIL, so they run
    on the cores the loop's Python (reading rows, accounting) leaves free: on an accelerator all
    but one; on the CPU those the forward's streams leave idle between batches, which with a small
    model is most of them. `MMENC_TOKENIZE_AHEAD=0|1` forces it."""
    want = os.environ.get("MMENC_TOKENIZE_AHEAD", "").strip()
    if want in ("0", "1"):
        return want == "1"
    return True


@dataclass(slots=True)
class Texts:
    """Items and their texts, in step: strings, per-text payloads from a pretokenizer, or one
    `TokenizedTexts` (the ids of all of them in flat arrays)."""

    items: list[Item]
    payloads: Payloads
    tokenized: bool = False  # payloads are a pretokenizer's (else strings)

    def __len__(self) -> int:
        return len(self.items)

    def then(self, other: "Texts") -> "Texts":
        """These texts followed by `other`'s (of the same kind)."""
        if isinstance(self.payloads, TokenizedTexts) and isinstance(other.payloads, TokenizedTexts):
            payloads: Payloads = TokenizedTexts.concat([self.payloads, other.payloads])
        else:
            payloads = list(self.payloads) + list(other.payloads)
        return Texts(self.items + other.items, payloads, self.tokenized)

    def same_kind(self, other: "Texts") -> bool:
        """Whether a batch may hold texts of both."""
        return self.tokenized == other.tokenized and (isinstance(self.payloads, TokenizedTexts)
                                                      == isinstance(other.payloads, TokenizedTexts))

    def by_length(self) -> "Texts":
        """Sorted by token count (characters for strings), ties kept in order."""
        if isinstance(self.payloads, TokenizedTexts):
            order = np.argsort(self.payloads.lengths, kind="stable")
            return Texts([self.items[i] for i in order.tolist()], self.payloads.take(order), self.tokenized)
        order = sorted(range(len(self.items)), key=lambda i: len(self.payloads[i]))
        return Texts([self.items[i] for i in order], [self.payloads[i] for i in order], self.tokenized)

    def __getitem__(self, key: slice) -> "Texts":
        return Texts(self.items[key], self.payloads[key], self.tokenized)


def pretokenize_window(window: Texts, pretokenize: Pretokenize | None) -> float:
    """Tokenize a window's texts in place (without padding); return the seconds it took. Without a
    `pretokenize` (or when it fails) the window keeps its strings and is bucketed by characters."""
    t0 = time.perf_counter()
    if pretokenize is not None and not window.tokenized and len(window):
        try:
            tokens = pretokenize(window.payloads)
        except Exception as exc:  # e.g. one odd text: keep the strings, batches bisect to it
            log.info("pretokenizing %d texts failed (%s: %s): bucketing by characters",
                     len(window), type(exc).__name__, exc)
        else:
            window.payloads, window.tokenized = tokens, True
    return time.perf_counter() - t0


class TextFeed:
    """Texts from `add` to `encode(items, payloads)` calls of at most 4 batches, sorted by length.

    Runs on the encode loop's thread; only the tokenizing of a window may run on another thread,
    which returns its seconds to be counted here.
    """

    def __init__(self, encoder: Encoder, batch_size: int, counters: Counters,
                 encode: Callable[[list[Item], Payloads], None], stop: threading.Event) -> None:
        self.batch_size, self.counters, self.encode, self.stop = batch_size, counters, encode, stop
        self.stopped = stop.is_set
        self.items: list[Item] = []  # waiting for their window to fill, with their texts
        self.texts: list[str] = []
        # windows cut and being (or done) tokenized, oldest first, each with its tokenize job (a
        # future when tokenized ahead, else its seconds)
        self.windows: collections.deque[tuple[Texts, Future[float] | float]] = collections.deque()
        self.carry: Texts | None = None  # sorted texts that did not fill a batch
        self.todo: Texts | None = None  # the window's sorted texts not yet handed to `encode`
        self.ahead: ThreadPoolExecutor | None = None
        if tokenize_ahead(encoder.device) and (ahead := encoder.text_pretokenizer(other_thread=True)):
            self.pretokenize: Pretokenize | None = ahead
            self.ahead = ThreadPoolExecutor(1, thread_name_prefix="mmenc-tokenize")
        else:
            self.pretokenize = encoder.text_pretokenizer(other_thread=False)

    def add(self, item: Item, text: str) -> None:
        """Accept one text (prefix already applied)."""
        self.items.append(item)
        self.texts.append(text)

    def pump(self) -> None:
        """Cut a full window; encode the windows before the one tokenizing ahead."""
        if len(self.items) >= max(TEXT_WINDOW, self.batch_size * 8):
            self._cut_window()
            while len(self.windows) > (1 if self.ahead is not None else 0) and not self.stopped():
                self._encode_window(final=False)

    def finish(self) -> None:
        """Encode every text left (the last batch may be short)."""
        if self.items:
            self._cut_window()
        while self.windows and not self.stopped():
            self._encode_window(final=len(self.windows) == 1)
        if self.carry is not None and not self.stopped():
            self._encode_window(final=True)

    def drop(self) -> dict[str, int]:
        """Give up the texts not encoded (the run stops as a whole); return how many."""
        self.close()
        dropped = len(self.items) + sum(len(w) for w, _ in self.windows)
        dropped += sum(len(t) for t in (self.carry, self.todo) if t is not None)
        self.items, self.texts, self.carry, self.todo = [], [], None, None
        self.windows.clear()
        return {"text": dropped}

    def close(self) -> None:
        """Stop the tokenize-ahead thread (waiting for the window it is on)."""
        if self.ahead is not None:
            self.ahead.shutdown(wait=True, cancel_futures=True)
            self.ahead = None

    def _cut_window(self) -> None:
        window = Texts(self.items, self.texts)
        self.items, self.texts = [], []
        if self.ahead is not None:
            self.windows.append((window, self.ahead.submit(pretokenize_window, window, self.pretokenize)))
            return
        self.windows.append((window, 0.0))  # first: a stop while tokenizing leaves it to `drop`
        with interruptible(self.stop):
            self.windows[-1] = (window, pretokenize_window(window, self.pretokenize))

    def _encode_window(self, final: bool) -> None:
        """Encode the oldest window (with the texts carried over) in full batches sorted by length;
        what does not fill a batch carries over, unless `final`."""
        window, job = self.windows.popleft() if self.windows else (None, 0.0)
        self.counters.add_seconds("tokenize", job if isinstance(job, float) else job.result())
        carry, self.carry = self.carry, None
        if carry is not None and window is not None and not carry.same_kind(window):
            self._encode_sorted(carry)  # a batch holds one kind of payload: the carry goes alone
            carry = None
            if self.stopped():
                self.carry = window  # not attempted: `drop` counts it
                return
        texts = window if carry is None else carry if window is None else carry.then(window)
        if texts is None:
            return
        texts = texts.by_length()
        bs = self.batch_size
        cut = len(texts) if final else (len(texts) // bs) * bs
        if cut < len(texts):
            self.carry = texts[cut:]
        self._encode_sorted(texts[:cut])

    def _encode_sorted(self, texts: Texts) -> None:
        """Hand sorted texts to `encode` 4 batches at a time; what a stop leaves is not attempted
        (`drop` counts it)."""
        self.todo = texts
        while len(self.todo) and not self.stopped():
            step = self.batch_size * 4
            part, self.todo = self.todo[:step], self.todo[step:]
            self.encode(part.items, part.payloads)
        if not len(self.todo):
            self.todo = None
