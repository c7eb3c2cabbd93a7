"""Image items: sent to the decode pool in chunks, collected as they finish, cut into batches.

The pool (`decode_pool.py`) loads, decodes and preprocesses images in worker processes with a
bounded number in flight; what comes back is an `ImageInput` or the item's `MMError`. A batch
holds at most `--batch-size` images and, with `--max-batch-tokens`, at most that many tokens
(each image's `meta["tokens"]`; an image over the budget goes alone).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..config import RunConfig
from ..encoders.base import Encoder, ImageInput
from ..errors import DeviceError, ModelLoadError, OutputError
from ..records import Item
from .counters import Counters
from .decode_pool import DecodePool
from .decode_worker import Decoded
from .failures import FailureSink

#: images per chunk handed to a worker at once (at most the batch size): fewer, larger hand-offs
#: keep the encode process's cost per image low (bench_feed: 0.06-0.07 ms at 32, 0.10-0.15 at 8)
CHUNK = 32

#: `Encoder.image_device_decoder()`: payloads -> each decoded on the device, or None where refused
DeviceDecode = Callable[[list[ImageInput]], "list[ImageInput | None]"]


def device_decoder(cfg: RunConfig, encoder: Encoder) -> DeviceDecode | None:
    """`--decode gpu`: the encoder's device decoder (ModelLoadError when it has none)."""
    if cfg.media.decode != "gpu":
        return None
    decode = encoder.image_device_decoder()
    if decode is None:
        raise ModelLoadError(f"--decode gpu: {cfg.model.model} preprocesses images with more than a resize "
                             "and a crop, which runs in the decode workers only; use --decode fast")
    return decode


class ImageFeed:
    """Images from `add` to `encode(items, payloads)` calls of one batch each, as they finish decoding.

    Runs on the encode loop's thread; the pool is made on the first image (`make_pool`), so a run
    without images starts no workers.
    """

    def __init__(self, make_pool: Callable[[], DecodePool], batch_size: int, max_batch_tokens: int | None,
                 counters: Counters, failures: FailureSink, encode: Callable[[list[Item], list[Any]], None],
                 device_decode: DeviceDecode | None = None) -> None:
        self.make_pool, self.batch_size, self.max_batch_tokens = make_pool, batch_size, max_batch_tokens
        self.counters, self.failures, self.encode = counters, failures, encode
        self.device_decode = device_decode  # --decode gpu: the batch's JPEGs are decoded on the device
        self.pool: DecodePool | None = None
        self.chunk: list[Item] = []  # waiting to be sent to the pool
        self.images: list[tuple[Item, Decoded]] = []  # decoded, waiting for their batch

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
        """Decode and encode every image left (again for those the device decoder sent back)."""
        self._submit()
        while True:
            if self.pool is not None:
                for chunk, results in self.pool.drain():
                    self._collect(chunk, results)
                    while (batch := self._take_batch(final=False)):
                        self._encode(batch)
            while (batch := self._take_batch(final=True)):
                self._encode(batch)
            pool = self.pool
            if pool is None or pool.in_flight == 0 or (pool.stop is not None and pool.stop.is_set()):
                return

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
        for k, (item, dec) in enumerate(zip(chunk, results)):
            self.counters.add_seconds("decode", sum(dec.seconds))
            if dec.error is not None:
                try:
                    self.failures.record(dec.error, item.row, "image")
                except OutputError:  # the report cannot be written: the chunk's rest waits for a re-run
                    self.counters.add("image", "not_attempted", len(chunk) - k - 1)
                    raise
            else:
                assert dec.value is not None
                self.images.append((item, dec))

    def _encode(self, batch: list[tuple[Item, Decoded]]) -> None:
        """Encode one batch; its pixels are copied out by then, so their shared-memory slots are freed."""
        try:
            kept = self._on_device(batch) if self.device_decode is not None else batch
            if kept:
                self.encode([item for item, _ in kept], [dec.value for _, dec in kept])
        finally:
            if self.pool is not None:
                for _, dec in batch:
                    self.pool.release(dec)

    def _on_device(self, batch: list[tuple[Item, Decoded]]) -> list[tuple[Item, Decoded]]:
        """Decode the batch's JPEGs on the device; those it refuses go back to the workers, to be
        decoded on the CPU (where a corrupt one becomes its error row)."""
        assert self.device_decode is not None and self.pool is not None
        t0 = time.perf_counter()
        try:
            values = self.device_decode([dec.value for _, dec in batch])  # type: ignore[misc]
        except DeviceError:  # the run ends: this batch is left for a re-run
            self.counters.add("image", "not_attempted", len(batch))
            raise
        self.counters.add_seconds("device_decode", time.perf_counter() - t0)
        kept, refused = [], []
        for (item, dec), value in zip(batch, values):
            if value is None:
                refused.append(item)
            else:
                dec.value = value
                kept.append((item, dec))
        if refused:
            self.pool.submit(refused, [(it.row.image, it.row.base_dir) for it in refused], cpu_only=True)
        return kept

    def _take_batch(self, final: bool) -> list[tuple[Item, Decoded]] | None:
        """Cut the next batch off `self.images`, or None when no full batch is ready yet: full by
        count, the next image would overflow the token budget, or at the end."""
        images, cap = self.images, self.batch_size
        if self.max_batch_tokens is None:
            cut = min(cap, len(images))
            if cut == 0 or (cut < cap and not final):
                return None
        else:
            cut = total = 0
            for _item, dec in images[:cap]:
                tokens = int(dec.value.meta.get("tokens") or 0)  # type: ignore[union-attr]
                if cut and total + tokens > self.max_batch_tokens:
                    break
                total += tokens
                cut += 1
            if cut == 0 or (cut == len(images) and cut < cap and not final):
                return None
        batch, self.images = images[:cut], images[cut:]
        return batch
