"""Stopping a run promptly: a stop request (SIGTERM, SIGINT, --fail-fast) is an event the run checks
between batches and rows; inside the stretches that may take long without reaching such a check
(loading the model, tokenizing a window, reading the output's history) it also interrupts at once.

`request_stop(stop)` is what a signal handler calls: it sets the event and, when the main thread
is inside an `interruptible(stop)` block, raises `Interrupted` there (signal handlers run on the
main thread, between bytecodes, so this lands in that block). The run catches `Interrupted`,
counts what it had not finished as "not attempted", records the task as interrupted and returns.

A call into an object store may wait on a store that never answers (up to its client's timeouts
and retries, minutes). `bounded(fn)` runs such a call on a helper thread and waits for it on any
thread: until a stop request, as long as the call takes; after one, `GRACE_S` at most (a healthy
store still takes the last shard and the task's record), then `StopWait`, an `OSError` the output
treats as its fault. `cut_short()` then tells the CLI that the run ended by the stop (exit 130/143).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

_depth = 0  # nesting of interruptible blocks on the main thread
_requested: list[tuple[float, int | None]] = []  # (when, signal) of this process's first stop request
_cut: list[str] = []  # the waits a stop request cut short

#: seconds a store call may still take after a stop request (MMENC_STOP_GRACE overrides)
GRACE_S = 5.0


class Interrupted(BaseException):
    """A stop request arrived inside an interruptible block (a BaseException, so that the
    `except Exception` of the code it interrupts, a model loader's, does not swallow it)."""


class StopWait(OSError):
    """A store call still unanswered `GRACE_S` after a stop request: the run stops waiting for it
    (an output fault, so nothing more is written; the exit code is the signal's)."""


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def interruptible(stop: threading.Event) -> Iterator[None]:
    """Within this block, on the main thread, a stop request raises `Interrupted` at once
    (elsewhere, and outside it, the request only sets `stop`)."""
    global _depth
    if not _on_main_thread():
        yield
        return
    if stop.is_set():
        raise Interrupted
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def request_stop(stop: threading.Event, signum: int | None = None) -> None:
    """Ask the run to stop: set `stop`; inside an interruptible block, also raise `Interrupted`.
    The first request starts the grace that bounds waits on a store (`bounded`)."""
    if not _requested:
        _requested.append((time.monotonic(), signum))
    stop.set()
    if _depth and _on_main_thread():
        raise Interrupted


def grace_s() -> float:
    """The seconds a store call may still take after a stop request."""
    try:
        return max(0.0, float(os.environ.get("MMENC_STOP_GRACE", GRACE_S)))
    except ValueError:
        return GRACE_S


def _deadline() -> float | None:
    return _requested[0][0] + grace_s() if _requested else None


def bounded(fn: Callable[[], T], what: str) -> T:
    """`fn()` (a call into a store, `what` names it), run on a helper thread; its result or its
    exception. After a stop request the wait lasts until the grace ends, then `StopWait` (the
    call is left to finish or fail on its own; its thread is a daemon)."""
    box: dict[str, object] = {}
    done = threading.Event()

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=call, name="mmenc-store-call", daemon=True).start()
    while not done.wait(0.1):
        deadline = _deadline()
        if deadline is not None and time.monotonic() >= deadline:
            _cut.append(what)
            raise StopWait(f"{what}: no answer {grace_s():g} s after the stop request")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def join(thread: threading.Thread) -> bool:
    """Join `thread` (one that calls a store), giving up when the grace after a stop request
    ends; whether it ended."""
    while thread.is_alive():
        thread.join(0.1)
        deadline = _deadline()
        if deadline is not None and time.monotonic() >= deadline:
            return not thread.is_alive()
    return True


def cut_short() -> list[str]:
    """The store waits a stop request cut short in this process (empty: none)."""
    return list(_cut)


def stop_exit_code() -> int:
    """The exit code of a run that a stop request ended: 128 + its signal (SIGTERM when unknown)."""
    signum = _requested[0][1] if _requested else None
    return 128 + int(signum if signum is not None else signal.SIGTERM)
