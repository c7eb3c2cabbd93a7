"""Media items (images, audio, video): sent to the decode pool in chunks, collected as they
finish, cut into batches of one medium.

The pool (`decode_pool.py`) loads, decodes and preprocesses them in worker processes with a
bounded number in flight; what comes back is the item's payload (`ImageInput`, `AudioInput`,
`VideoInput`) or its `MMError`. A batch holds at most its medium's batch size (`--batch-size`; for
video, that many frames: `--batch-size` // frames clips) and, with `--max-batch-tokens`, at most
that many tokens (each payload's `meta["tokens"]`; one over the budget goes alone).
"""

from __future__ import annotations

import collections
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


class MediaFeed:
    """Media items from `add` to `encode(modality, items, payloads)` calls of one batch each, as
    they finish decoding.

    Runs on the encode loop's thread; the pool is made on the first item (`make_pool`), so a run
    without media starts no workers. `batch_sizes`: items per batch of each medium.
    """

    def __init__(self, make_pool: Callable[[], DecodePool], batch_sizes: dict[str, int], max_batch_tokens: int | None,
                 counters: Counters, failures: FailureSink, encode: Callable[[str, list[Item], list[Any]], None],
                 device_decode: DeviceDecode | None = None) -> None:
        self.make_pool, self.batch_sizes, self.max_batch_tokens = make_pool, batch_sizes, max_batch_tokens
        self.counters, self.failures, self.encode = counters, failures, encode
        self.device_decode = device_decode  # --decode gpu: the batch's JPEGs are decoded on the device
        self.pool: DecodePool | None = None
        self.chunks: dict[str, list[Item]] = collections.defaultdict(list)  # waiting to be sent to the pool
        #: decoded, waiting for their batch, per medium
        self.decoded: dict[str, list[tuple[Item, Decoded]]] = collections.defaultdict(list)
        self.in_flight: collections.Counter[str] = collections.Counter()  # in the pool, per medium

    def add(self, item: Item) -> None:
        """Accept one media item; a full chunk goes to the pool."""
        if self.pool is None:
            self.pool = self.make_pool()
        chunk = self.chunks[item.modality]
        chunk.append(item)
        if len(chunk) >= max(1, min(CHUNK, self.batch_sizes[item.modality])):
            self._submit(item.modality)

    def pump(self) -> None:
        """Collect finished decodes (blocking only when the pool is full); encode full batches."""
        if self.pool is None:
            return
        for chunk, results in self.pool.ready():
            self._collect(chunk, results)
        self._encode_ready(final=False)

    def finish(self) -> None:
        """Decode and encode every item left (again for images the device decoder sent back)."""
        for modality in list(self.chunks):
            self._submit(modality)
        while True:
            if self.pool is not None:
                for chunk, results in self.pool.drain():
                    self._collect(chunk, results)
                    self._encode_ready(final=False)
            self._encode_ready(final=True)
            pool = self.pool
            if pool is None or pool.in_flight == 0 or (pool.stop is not None and pool.stop.is_set()):
                return

    def _encode_ready(self, final: bool) -> None:
        for modality in list(self.decoded):
            while (batch := self._take_batch(modality, final)):
                self._encode(modality, batch)

    def drop(self) -> dict[str, int]:
        """Give up the items not encoded (the run stops as a whole); return how many per medium."""
        dropped = collections.Counter(self.in_flight)
        for modality, items in (*self.chunks.items(), *self.decoded.items()):
            dropped[modality] += len(items)
        self.chunks.clear()
        self.decoded.clear()
        self.in_flight.clear()
        self.close(kill=True)
        return dict(dropped)

    def close(self, kill: bool = False) -> None:
        """Stop the workers (at once with `kill`, dropping what is in flight)."""
        if self.pool is not None:
            self.pool.close(kill=kill)

    def _submit(self, modality: str, items: list[Item] | None = None, cpu_only: bool = False) -> None:
        chunk = items if items is not None else self.chunks.pop(modality, [])
        if chunk:
            assert self.pool is not None
            self.pool.submit(chunk, [(it.row.value(modality), it.row.base_dir) for it in chunk],  # type: ignore[misc]
                             cpu_only=cpu_only, modality=modality)
            self.in_flight[modality] += len(chunk)

    def _collect(self, chunk: list[Item], results: list[Decoded] | None) -> None:
        modality = chunk[0].modality
        self.in_flight[modality] -= len(chunk)
        if results is None:  # the pool died while the run is stopping: neither written nor errored
            self.counters.add(modality, "not_attempted", len(chunk))
            return
        for k, (item, dec) in enumerate(zip(chunk, results)):
            self.counters.add_seconds("decode", sum(dec.seconds))
            if dec.error is not None:
                try:
                    self.failures.record(dec.error, item.row, modality)
                except OutputError:  # the report cannot be written: the chunk's rest waits for a re-run
                    self.counters.add(modality, "not_attempted", len(chunk) - k - 1)
                    raise
            else:
                assert dec.value is not None
                item.cut = bool(dec.value.meta.get("cut"))  # a clip cut at its limit: counted as truncated
                self.decoded[modality].append((item, dec))

    def _encode(self, modality: str, batch: list[tuple[Item, Decoded]]) -> None:
        """Encode one batch; its pixels are copied out by then, so their shared-memory slots are freed."""
        try:
            kept = self._on_device(batch) if self.device_decode is not None and modality == "image" else batch
            if kept:
                self.encode(modality, [item for item, _ in kept], [dec.value for _, dec in kept])
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
            self._submit("image", refused, cpu_only=True)
        return kept

    def _take_batch(self, modality: str, final: bool) -> list[tuple[Item, Decoded]] | None:
        """Cut the next batch off `self.decoded[modality]`, or None when no full batch is ready
        yet: full by count, the next item would overflow the token budget, or at the end."""
        images, cap = self.decoded[modality], self.batch_sizes[modality]
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
        batch, self.decoded[modality] = images[:cut], images[cut:]
        return batch
