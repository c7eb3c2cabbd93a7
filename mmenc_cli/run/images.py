"""Image items: sent to the decode pool in chunks, collected in order, cut into batches.

The pool (`decode_pool.py`) loads, decodes and preprocesses images in worker processes with a
bounded number in flight; what comes back is an `ImageInput` or the item's `MMError`. A batch
holds at most `--batch-size` images and, with `--max-batch-tokens`, at most that many tokens
(each image's `meta["tokens"]`; an image over the budget goes alone).
"""

from __future__ import annotations

from typing import Any, Callable

from ..encoders.base import ImageInput
from ..records import Item
from .counters import Counters
from .decode_pool import Decoded, DecodePool
from .failures import FailureSink

#: images per chunk handed to a worker at once (at most the batch size)
CHUNK = 8


class ImageFeed:
    """Images from `add` to `encode(items, payloads)` calls of one batch each, in manifest order.

    Runs on the encode loop's thread; the pool is made on the first image (`make_pool`), so a run
    without images starts no workers.
    """

    def __init__(self, make_pool: Callable[[], DecodePool], batch_size: int, max_batch_tokens: int | None,
                 counters: Counters, failures: FailureSink,
                 encode: Callable[[list[Item], list[Any]], None]) -> None:
        self.make_pool, self.batch_size, self.max_batch_tokens = make_pool, batch_size, max_batch_tokens
        self.counters, self.failures, self.encode = counters, failures, encode
        self.pool: DecodePool | None = None
        self.chunk: list[Item] = []  # waiting to be sent to the pool
        self.images: list[tuple[Item, ImageInput]] = []  # decoded, waiting for their batch

    def add(self, item: Item) -> None:
        """Accept one image item; a full chunk goes to the pool."""
        if self.pool is None:
            self.pool = self.make_pool()
        self.chunk.append(item)
        if len(self.chunk) >= max(1, min(CHUNK, self.batch_size)):
            self._submit()

    def pump(self) -> None:
        """Collect finished decodes (blocking only when the pool is full); encode full batches."""
        if self.pool is None:
            return
        for chunk, results in self.pool.ready():
            self._collect(chunk, results)
        while (batch := self._take_batch(final=False)):
            self._encode(batch)

    def finish(self) -> None:
        """Decode and encode every image left."""
        self._submit()
        if self.pool is not None:
            for chunk, results in self.pool.drain():
                self._collect(chunk, results)
                while (batch := self._take_batch(final=False)):
                    self._encode(batch)
        while (batch := self._take_batch(final=True)):
            self._encode(batch)

    def drop(self) -> int:
        """Give up the images not encoded (the run stops as a whole); return how many."""
        dropped = len(self.chunk) + len(self.images) + (self.pool.in_flight if self.pool is not None else 0)
        self.chunk, self.images = [], []
        self.close(kill=True)
        return dropped

    def close(self, kill: bool = False) -> None:
        """Stop the workers (at once with `kill`, dropping what is in flight)."""
        if self.pool is not None:
            self.pool.close(kill=kill)

    def _submit(self) -> None:
        if self.chunk:
            chunk, self.chunk = self.chunk, []
            assert self.pool is not None
            self.pool.submit(chunk, [(it.row.image, it.row.base_dir) for it in chunk])

    def _collect(self, chunk: list[Item], results: list[Decoded] | None) -> None:
        if results is None:  # the pool died while the run is stopping: neither written nor errored
            self.counters.add("image", "not_attempted", len(chunk))
            return
        for item, dec in zip(chunk, results):
            self.counters.add_seconds("decode", sum(dec.seconds))
            if dec.error is not None:
                self.failures.record(dec.error, item.row, "image")
            else:
                assert dec.value is not None
                self.images.append((item, dec.value))

    def _encode(self, batch: list[tuple[Item, ImageInput]]) -> None:
        self.encode([b[0] for b in batch], [b[1] for b in batch])

    def _take_batch(self, final: bool) -> list[tuple[Item, ImageInput]] | None:
        """Cut the next batch off `self.images`, or None when no full batch is ready yet: full by
        count, the next image would overflow the token budget, or at the end."""
        images, cap = self.images, self.batch_size
        if self.max_batch_tokens is None:
            cut = min(cap, len(images))
            if cut == 0 or (cut < cap and not final):
                return None
        else:
            cut = total = 0
            for _item, payload in images[:cap]:
                tokens = int(payload.meta.get("tokens") or 0)
                if cut and total + tokens > self.max_batch_tokens:
                    break
                total += tokens
                cut += 1
            if cut == 0 or (cut == len(images) and cut < cap and not final):
                return None
        batch, self.images = images[:cut], images[cut:]
        return batch
