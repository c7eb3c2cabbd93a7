"""Fetching a chunk's object-store images ahead, in a decode worker, while it decodes the ones before.

A worker gets its images in chunks (`run/decode_pool.py`); one by one, an S3 image costs a round
trip each and the worker waits for every one. Here all the S3 images of a chunk are asked for at
once, as coroutines on fsspec's event loop (one GetObject each, `stores.get_object`), and the
worker takes each as it comes to it, in order. Memory is bounded by bytes: a body is read only
once its size (the answer's Content-Length) fits the worker's budget of fetched bytes not yet
taken; sizes are granted in the chunk's order, so the image the worker waits for is never stuck
behind later ones (alone, it may exceed the budget). A failed fetch is that image's `MMError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any

from ..config import MediaConfig
from ..errors import MMError, classify
from .sources import describe_source
from .stores import filesystem, get_object, is_s3


@dataclass(frozen=True)
class Fetched:
    """An image fetched ahead, in place of its URL: its bytes, or the `MMError` its fetch ended with."""

    data: bytes | None
    error: MMError | None

    def payload(self) -> bytes:
        """The bytes; the fetch's error raised instead when it failed."""
        if self.error is not None:
            raise self.error
        assert self.data is not None
        return self.data


class Budget:
    """Bytes granted to bodies not yet taken, in turn order. Lives on the event loop (not thread-safe)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used, self.turn = max(1, cap), 0, 0
        self.passed: set[int] = set()  # turns granted or given up, not yet reached
        self.changed: asyncio.Condition | None = None  # made on the loop, at first use

    def _condition(self) -> asyncio.Condition:
        if self.changed is None:
            self.changed = asyncio.Condition()
        return self.changed

    async def take(self, turn: int, size: int) -> None:
        """Wait for `turn` and for `size` bytes to fit (or for nothing else to be held); take them."""
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self.turn == turn and (self.used == 0 or self.used + size <= self.cap))
            self.used += size
            self._pass(turn)
            changed.notify_all()

    async def skip(self, turn: int) -> None:
        """`turn` takes nothing (its fetch failed before its size was known): the next may go."""
        changed = self._condition()
        async with changed:
            self._pass(turn)
            changed.notify_all()

    async def give(self, size: int) -> None:
        """`size` bytes taken by the decoder (or dropped): free for the bodies waiting."""
        changed = self._condition()
        async with changed:
            self.used -= size
            changed.notify_all()

    def _pass(self, turn: int) -> None:
        self.passed.add(turn)
        while self.turn in self.passed:
            self.passed.discard(self.turn)
            self.turn += 1


class FetchAhead:
    """The S3 images among a chunk's sources (`urls`: position -> URL), all asked for at once;
    `take(position)` waits for one. Close it when the chunk is done (what was not taken is cancelled)."""

    def __init__(self, urls: dict[int, str], cfg: MediaConfig, budget_bytes: int) -> None:
        self.cfg = cfg
        self.budget = Budget(budget_bytes)
        self.loop: Any = None
        self.pending: dict[int, concurrent.futures.Future[tuple[Fetched, int]]] = {}
        self.given: list[concurrent.futures.Future[None]] = []  # bytes given back to the budget
        for position, url in urls.items():
            try:
                fs, inner = filesystem(url)
            except Exception:  # fetched in place, where the same error becomes the item's
                continue
            if not is_s3(fs) or (self.loop is not None and fs.loop is not self.loop):
                continue
            self.loop = fs.loop
            coro = self._fetch(len(self.pending), fs, inner, str(describe_source(url)))
            self.pending[position] = asyncio.run_coroutine_threadsafe(coro, fs.loop)

    def __contains__(self, position: int) -> bool:
        return position in self.pending

    def take(self, position: int) -> Fetched:
        """The image at `position` (waiting for its fetch); its bytes leave the budget."""
        try:
            fetched, size = self.pending.pop(position).result()
        except Exception as exc:  # pragma: no cover - _fetch returns its failures; a loop gone is this image's
            return Fetched(None, classify(exc, "load"))
        if size:  # not waited for: the decoder goes on at once
            self.given.append(asyncio.run_coroutine_threadsafe(self.budget.give(size), self.loop))
        return fetched

    def close(self) -> None:
        """Cancel the fetches not taken (a chunk left early); wait for the bytes taken to be given back."""
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        concurrent.futures.wait(self.given, timeout=5)
        self.given.clear()

    async def _fetch(self, turn: int, fs: Any, path: str, shown: str) -> tuple[Fetched, int]:
        granted, turned = 0, False

        async def reserve(size: int) -> None:
            nonlocal granted, turned
            await self.budget.take(turn, size)
            granted, turned = size, True

        try:
            return Fetched(await get_object(fs, path, self.cfg, shown, reserve), None), granted
        except Exception as exc:  # one image's failure; get_object raises MMErrors, anything else is a bug's
            if granted:
                await self.budget.give(granted)
            return Fetched(None, classify(exc, "load")), 0
        finally:
            if not turned:  # failed before its size was known: the turns after it go on
                await self.budget.skip(turn)
