"""Media items (images, audio, video): sent to the decode pool in chunks, collected as they
finish, cut into batches of one medium.

The pool (`decode_pool.py`) loads, decodes and preprocesses them in worker processes with a
bounded number in flight; what comes back is the item's payload (`ImageInput`, `AudioInput`,
`VideoInput`) or its `MMError`. A batch holds at most its medium's batch size (`--batch-size`; for
video, that many frames: `--batch-size` // frames clips) and, with `--max-batch-tokens`, at most
that many tokens (each payload's `meta["tokens"]`; one over the budget goes alone).

Memory is bounded by bytes as well as by count: the items waiting to be sent and those in the
workers hold at most `--max-inflight-bytes` of undecoded payload (one larger item goes alone).
Only inline bytes (tar members, Parquet and Arrow image bytes) count: a path's or URL's size is
not known before a worker loads it (a worker's S3 images fetched ahead have a budget of their own,
`DecodePool.fetch_bytes`: each worker's share of `--max-inflight-bytes`). An item's bytes are dropped once sent (`Item.source`), and
its row never holds them (`released`), so nothing after the decode keeps them.

Under `--decode gpu` the workers send plain JPEGs on as their bytes; a batch of them starts
decoding on the device (the encoder's `DeviceDecoder`, on a thread of its own) as soon as it is
cut, and is launched once decoded, so batch N + 1 decodes while batch N's forward runs. The JPEGs
the device refuses go back to the workers (`DecodePool.spread`: small chunks the workers share).
"""

from __future__ import annotations

import collections
import time
from dataclasses import replace
from typing import Any, Callable

from ..config import RunConfig
from ..encoders.base import DecodeAhead, DeviceDecoder, Encoder
from ..errors import DeviceError, ModelLoadError, OutputError
from ..media.sources import describe_source
from ..records import MEDIA, Item, ManifestRow, Released
from .counters import Counters
from .decode_pool import DecodePool
from .decode_worker import Decoded
from .failures import FailureSink

#: images per chunk handed to a worker at once (at most the batch size): fewer, larger hand-offs
#: keep the encode process's cost per image low (bench_feed: 0.06-0.07 ms at 32, 0.10-0.15 at 8)
CHUNK = 32

#: batches whose JPEGs are decoding on the device at once: the one the next forward needs, and the
#: one after it (decoding while that forward runs)
DECODE_AHEAD = 2

#: a batch waiting for its device decode: its items with their worker results, and the decode
Decoding = tuple[list[tuple[Item, Decoded]], DecodeAhead]


def device_decoder(cfg: RunConfig, encoder: Encoder) -> DeviceDecoder | None:
    """`--decode gpu`: the encoder's device decoder (ModelLoadError when it has none)."""
    if cfg.media.decode != "gpu":
        return None
    decode = encoder.image_device_decoder()
    if decode is None:
        raise ModelLoadError(f"--decode gpu: {cfg.model.model} preprocesses images with more than a resize "
                             "and a crop, which runs in the decode workers only; use --decode fast")
    return decode


def inline_bytes(source: object) -> int:
    """The undecoded bytes an item carries: its inline bytes' length; 0 for a path or URL."""
    return len(source) if isinstance(source, (bytes, bytearray, memoryview)) else 0


def released(row: ManifestRow) -> ManifestRow:
    """`row` without its inline media bytes, each replaced by what the error report shows for it
    (`Released`); `row` itself when it has none. Its items carry their own bytes (`Item.source`)."""
    inline = {m: Released(describe_source(v)) for m in MEDIA if inline_bytes(v := row.value(m))}
    return replace(row, **inline) if inline else row


class MediaFeed:
    """Media items from `add` to `encode(modality, items, payloads)` calls of one batch each, as
    they finish decoding.

    Runs on the encode loop's thread; the pool is made on the first item (`make_pool`), so a run
    without media starts no workers. `batch_sizes`: items per batch of each medium. `max_bytes`:
    the undecoded bytes waiting and in the pool at once; a chunk goes once it holds `chunk_bytes`
    (a share of them, so every worker gets some).
    """

    def __init__(self, make_pool: Callable[[], DecodePool], batch_sizes: dict[str, int], max_batch_tokens: int | None,
                 counters: Counters, failures: FailureSink, encode: Callable[[str, list[Item], list[Any]], None],
                 device_decode: DeviceDecoder | None = None, max_bytes: int | None = None,
                 chunk_bytes: int | None = None) -> None:
        self.make_pool, self.batch_sizes, self.max_batch_tokens = make_pool, batch_sizes, max_batch_tokens
        self.max_bytes = max_bytes if max_bytes is not None else float("inf")
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else self.max_bytes
        self.counters, self.failures, self.encode = counters, failures, encode
        self.device_decode = device_decode  # --decode gpu: the batch's JPEGs are decoded on the device
        self.decoding: collections.deque[Decoding] = collections.deque()  # in decode order
        self.pool: DecodePool | None = None
        self.chunks: dict[str, list[Item]] = collections.defaultdict(list)  # waiting to be sent to the pool
        #: decoded, waiting for their batch, per medium
        self.decoded: dict[str, list[tuple[Item, Decoded]]] = collections.defaultdict(list)
        self.in_flight: collections.Counter[str] = collections.Counter()  # in the pool, per medium
        self.waiting_bytes: collections.Counter[str] = collections.Counter()  # inline bytes of `chunks`
        self.held_bytes = 0  # inline bytes waiting in `chunks` or in the pool

    def add(self, item: Item) -> None:
        """Accept one media item (first waiting, when the bytes budget is spent, for the pool to
        return some); a full chunk goes to the pool."""
        if self.pool is None:
            self.pool = self.make_pool()
        size = inline_bytes(item.source)
        self._make_room(size)
        if self.waiting_bytes[item.modality] and self.waiting_bytes[item.modality] + size > self.chunk_bytes:
            self._submit(item.modality)  # a chunk stays within its share: a worker holds its chunk whole
        chunk = self.chunks[item.modality]
        chunk.append(item)
        self.waiting_bytes[item.modality] += size
        self.held_bytes += size
        if len(chunk) >= max(1, min(CHUNK, self.batch_sizes[item.modality])) \
                or self.waiting_bytes[item.modality] >= self.chunk_bytes:
            self._submit(item.modality)

    def _make_room(self, size: int) -> None:
        """Collect decodes until `size` more bytes fit the budget (an item larger than the whole
        budget waits for an empty pool and goes alone); a stop request ends the wait."""
        assert self.pool is not None
        while size and self.held_bytes and self.held_bytes + size > self.max_bytes:
            for modality in list(self.chunks):  # what waits goes: the pool then holds every byte counted
                self._submit(modality)
            done = next(self.pool.drain(), None)
            if done is None:  # stopping, or nothing in flight
                return
            self._collect(*done)
            self._encode_ready(final=False)

    def pump(self) -> None:
        """Collect finished decodes (blocking only when the pool is full); encode full batches."""
        if self.pool is None:
            return
        for chunk, results in self.pool.ready():
            self._collect(chunk, results)
        self._encode_ready(final=False)
        self._launch_decoded(block=False)

    def idle(self) -> None:
        """Before the loop waits for the workers: launch what the device has decoded (or is
        decoding), so the device is not idle while the loop waits."""
        self._launch_decoded(block=True)

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
            self._launch_decoded(block=True)
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
        while self.decoding:
            batch, ahead = self.decoding.popleft()
            dropped["image"] += len(batch)
            self._forget(batch, ahead)
        self.chunks.clear()
        self.decoded.clear()
        self.in_flight.clear()
        self.waiting_bytes.clear()
        self.held_bytes = 0
        self.close(kill=True)
        return dict(dropped)

    def close(self, kill: bool = False) -> None:
        """Stop the device's decode thread and the workers (at once with `kill`, dropping what is
        in flight); the thread first: it may be reading JPEGs in the workers' shared memory."""
        if self.device_decode is not None:
            self.device_decode.close()
        if self.pool is not None:
            self.pool.close(kill=kill)

    def _submit(self, modality: str, items: list[Item] | None = None, cpu_only: bool = False) -> None:
        """Send a chunk (the one waiting, or `items`, not counted yet) to the pool; its items keep
        no source: the pool holds it until their results come back."""
        chunk = items if items is not None else self.chunks.pop(modality, [])
        if not chunk:
            return
        assert self.pool is not None
        sources = [(it.source, it.row.base_dir) for it in chunk]
        nbytes = sum(inline_bytes(src) for src, _ in sources)
        if items is None:
            self.waiting_bytes.pop(modality, None)
        else:
            self.held_bytes += nbytes
        for it in chunk:
            it.source = None
        self.pool.submit((chunk, nbytes), sources, cpu_only=cpu_only, modality=modality)  # type: ignore[arg-type]
        self.in_flight[modality] += len(chunk)

    def _collect(self, key: tuple[list[Item], int], results: list[Decoded] | None) -> None:
        chunk, nbytes = key
        modality = chunk[0].modality
        self.in_flight[modality] -= len(chunk)
        self.held_bytes -= nbytes
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
        """Encode one batch; its pixels are copied out by then, so their shared-memory slots are
        freed. Under `--decode gpu` an image batch starts decoding on the device instead, and the
        batch before it is launched (its decode is done or nearly: it started first)."""
        if self.device_decode is not None and modality == "image":
            self.decoding.append((batch, self.device_decode.start([dec.value for _, dec in batch])))  # type: ignore[misc]
            self._launch_decoded(block=True, keep=DECODE_AHEAD - 1)
            return
        try:
            self.encode(modality, [item for item, _ in batch], [dec.value for _, dec in batch])
        finally:
            self._release(batch)

    def _launch_decoded(self, block: bool, keep: int = 0) -> None:
        """Encode the batches the device has decoded, oldest first: with `block`, all but the last
        `keep` (waiting for their decodes); else those already done."""
        while len(self.decoding) > keep and (block or self.decoding[0][1].done()):
            batch, ahead = self.decoding.popleft()
            try:
                kept = self._on_device(batch, ahead)
                if kept:
                    self.encode("image", [item for item, _ in kept], [dec.value for _, dec in kept])
            finally:
                self._release(batch)

    def _on_device(self, batch: list[tuple[Item, Decoded]], ahead: DecodeAhead) -> list[tuple[Item, Decoded]]:
        """The batch's device decode, waited for; the JPEGs it refused go back to the workers, to be
        decoded on the CPU (where a corrupt one becomes its error row), in small chunks that
        several workers share."""
        assert self.pool is not None
        t0 = time.perf_counter()
        try:
            values = ahead.wait()
        except DeviceError:  # the run ends: this batch is left for a re-run
            self.counters.add("image", "not_attempted", len(batch))
            raise
        self.counters.add_seconds("device_decode_wait", time.perf_counter() - t0)
        self.counters.add_seconds("device_decode", ahead.seconds)
        kept, refused = [], []
        for (item, dec), value in zip(batch, values):
            if value is None:  # its JPEG's bytes go back (the item keeps no source): never fetched twice
                item.source = dec.value.pixels.tobytes()  # type: ignore[union-attr]
                refused.append(item)
            else:
                dec.value = value
                kept.append((item, dec))
        for chunk in self.pool.spread(refused):
            self._submit("image", chunk, cpu_only=True)
        return kept

    def _forget(self, batch: list[tuple[Item, Decoded]], ahead: DecodeAhead) -> None:
        """A batch dropped while its decode may still read its slots: wait for it, then free them."""
        try:
            ahead.wait()
        except Exception:  # the run is ending already; what failed here is left for a re-run
            pass
        self._release(batch)

    def _release(self, batch: list[tuple[Item, Decoded]]) -> None:
        if self.pool is not None:
            for _, dec in batch:
                self.pool.release(dec)

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
