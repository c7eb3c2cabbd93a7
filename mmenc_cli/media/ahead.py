"""Fetching a chunk's object-store images ahead, in a decode worker, while it decodes the ones before.

A worker gets its images in chunks (`run/decode_pool.py`); one by one, an S3 image costs a round
trip each and the worker waits for every one. Here all the S3 images of a chunk are asked for at
once (one GetObject each), and the worker takes each as it comes to it, in order. The GETs run on
`THREADS` threads of this process sharing one plain botocore client (`stores.fetch_object`): per
object it costs less CPU than aiobotocore, and the threads keep up with the store where the event
loop did not. Where the filesystem has options that client does not map, they run as coroutines on
fsspec's event loop instead (`stores.get_object`). Memory is bounded by bytes: a body is read only
once its size (the answer's Content-Length) fits the worker's budget of fetched bytes not yet
taken; sizes are granted in the chunk's order, so the image the worker waits for is never stuck
behind later ones (alone, it may exceed the budget). A failed fetch is that image's `MMError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from dataclasses import dataclass
from typing import Any

from ..config import MediaConfig
from ..errors import MMError, classify
from .sources import describe_source
from .stores import blocking_client, fetch_object, filesystem, get_object, is_s3

#: GETs one process keeps in flight on threads (its client's connections, `stores.POOL_CONNECTIONS`):
#: 32 kept up with the store's own 16-thread rate better than 8 or 16 while the worker decodes
THREADS = 32
_POOL: list[tuple[int, concurrent.futures.ThreadPoolExecutor]] = []  # this process's (pid, pool)
_POOL_LOCK = threading.Lock()


def thread_pool() -> concurrent.futures.ThreadPoolExecutor:
    """This process's threads for GETs, made at first use (a pool does not survive a fork)."""
    with _POOL_LOCK:
        if not _POOL or _POOL[0][0] != os.getpid():
            _POOL[:] = [(os.getpid(), concurrent.futures.ThreadPoolExecutor(THREADS, "store-get"))]
        return _POOL[0][1]


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


class Turns:
    """Bytes granted to bodies not yet taken, in turn order: the state both budgets share."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used, self.turn = max(1, cap), 0, 0
        self.passed: set[int] = set()  # turns granted or given up, not yet reached

    def fits(self, turn: int, size: int) -> bool:
        """`turn` is next, and `size` bytes fit (or nothing else is held)."""
        return self.turn == turn and (self.used == 0 or self.used + size <= self.cap)

    def _pass(self, turn: int) -> None:
        self.passed.add(turn)
        while self.turn in self.passed:
            self.passed.discard(self.turn)
            self.turn += 1


class Budget(Turns):
    """`Turns` for fetches on the event loop (not thread-safe)."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.changed: asyncio.Condition | None = None  # made on the loop, at first use

    def _condition(self) -> asyncio.Condition:
        if self.changed is None:
            self.changed = asyncio.Condition()
        return self.changed

    async def take(self, turn: int, size: int) -> None:
        """Wait for `turn` and for `size` bytes to fit (or for nothing else to be held); take them."""
        changed = self._condition()
        async with changed:
            await changed.wait_for(lambda: self.fits(turn, size))
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


class ThreadBudget(Turns):
    """`Turns` for fetches on threads. Closed, it grants nothing more: a thread waiting gives up."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.changed = threading.Condition()
        self.closed = False

    def take(self, turn: int, size: int) -> None:
        """Wait for `turn` and for `size` bytes to fit; take them. `Closed` once the chunk is done."""
        with self.changed:
            self.changed.wait_for(lambda: self.closed or self.fits(turn, size))
            if self.closed:
                raise Closed("the chunk was left before this image was taken")
            self.used += size
            self._pass(turn)
            self.changed.notify_all()

    def skip(self, turn: int) -> None:
        """`turn` takes nothing (its fetch failed before its size was known): the next may go."""
        with self.changed:
            self._pass(turn)
            self.changed.notify_all()

    def give(self, size: int) -> None:
        """`size` bytes taken by the decoder (or dropped): free for the bodies waiting."""
        with self.changed:
            self.used -= size
            self.changed.notify_all()

    def close(self) -> None:
        """Wake and end every wait: what was not taken will not be."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()


class Closed(Exception):
    """A fetch given up: its chunk was closed before the budget granted its body."""


class FetchAhead:
    """The S3 images among a chunk's sources (`urls`: position -> URL), all asked for at once;
    `take(position)` waits for one. Close it when the chunk is done (what was not taken is dropped)."""

    def __init__(self, urls: dict[int, str], cfg: MediaConfig, budget_bytes: int) -> None:
        self.cfg, self.cap = cfg, budget_bytes
        self.budget: Budget | ThreadBudget | None = None  # by the first S3 image: threads, else the loop
        self.loop: Any = None
        self.pending: dict[int, concurrent.futures.Future[tuple[Fetched, int]]] = {}
        self.given: list[concurrent.futures.Future[None]] = []  # bytes given back to the loop's budget
        for position, url in urls.items():
            try:
                fs, inner = filesystem(url)
            except Exception:  # fetched in place, where the same error becomes the item's
                continue
            if is_s3(fs):
                self._ask(position, fs, inner, str(describe_source(url)))

    def _ask(self, position: int, fs: Any, inner: str, shown: str) -> None:
        """Start the fetch of one image (in the way the chunk's first took; one that cannot is read in place)."""
        client = blocking_client(fs) if not isinstance(self.budget, Budget) else None
        turn = len(self.pending)
        if client is not None:
            self.budget = self.budget or ThreadBudget(self.cap)
            self.pending[position] = thread_pool().submit(self._get, turn, client, fs, inner, shown)
        elif not isinstance(self.budget, ThreadBudget) and self.loop in (None, fs.loop):
            self.budget, self.loop = self.budget or Budget(self.cap), fs.loop
            self.pending[position] = asyncio.run_coroutine_threadsafe(self._fetch(turn, fs, inner, shown), fs.loop)

    def __contains__(self, position: int) -> bool:
        return position in self.pending

    def take(self, position: int) -> Fetched:
        """The image at `position` (waiting for its fetch); its bytes leave the budget."""
        try:
            fetched, size = self.pending.pop(position).result()
        except Exception as exc:  # pragma: no cover - fetches return their failures; a loop gone is this image's
            return Fetched(None, classify(exc, "load"))
        if size and isinstance(self.budget, ThreadBudget):
            self.budget.give(size)
        elif size:  # not waited for: the decoder goes on at once
            self.given.append(asyncio.run_coroutine_threadsafe(self.budget.give(size), self.loop))  # type: ignore[union-attr]
        return fetched

    def close(self) -> None:
        """Cancel the fetches not taken (a chunk left early); wait for the bytes taken to be given back."""
        for future in self.pending.values():
            future.cancel()
        self.pending.clear()
        if isinstance(self.budget, ThreadBudget):
            self.budget.close()
        concurrent.futures.wait(self.given, timeout=5)
        self.given.clear()

    def _get(self, turn: int, client: Any, fs: Any, path: str, shown: str) -> tuple[Fetched, int]:
        """One image's fetch on a thread: `_fetch`'s twin, with the plain botocore client."""
        budget, granted, turned = self.budget, 0, False
        assert isinstance(budget, ThreadBudget)

        def reserve(size: int) -> None:
            nonlocal granted, turned
            budget.take(turn, size)
            granted, turned = size, True

        try:
            return Fetched(fetch_object(client, fs, path, self.cfg, shown, reserve), None), granted
        except Exception as exc:  # one image's failure; fetch_object raises MMErrors, anything else is a bug's
            if granted:
                budget.give(granted)
            return Fetched(None, classify(exc, "load")), 0
        finally:
            if not turned:  # failed before its size was known: the turns after it go on
                budget.skip(turn)

    async def _fetch(self, turn: int, fs: Any, path: str, shown: str) -> tuple[Fetched, int]:
        granted, turned = 0, False
        budget = self.budget
        assert isinstance(budget, Budget)

        async def reserve(size: int) -> None:
            nonlocal granted, turned
            await budget.take(turn, size)
            granted, turned = size, True

        try:
            return Fetched(await get_object(fs, path, self.cfg, shown, reserve), None), granted
        except Exception as exc:  # one image's failure; get_object raises MMErrors, anything else is a bug's
            if granted:
                await budget.give(granted)
            return Fetched(None, classify(exc, "load")), 0
        finally:
            if not turned:  # failed before its size was known: the turns after it go on
                await budget.skip(turn)
