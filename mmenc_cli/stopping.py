"""Stopping a run promptly: a stop request (SIGTERM, SIGINT, --fail-fast) is an event the run checks
between batches and rows; inside the stretches that may take long without reaching such a check
(loading the model, tokenizing a window, reading the output's history) it also interrupts at once.

`request_stop(stop)` is what a signal handler calls: it sets the event and, when the main thread
is inside an `interruptible(stop)` block, raises `Interrupted` there (signal handlers run on the
main thread, between bytecodes, so this lands in that block). The run catches `Interrupted`,
counts what it had not finished as "not attempted", records the task as interrupted and returns.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_depth = 0  # nesting of interruptible blocks on the main thread


class Interrupted(BaseException):
    """A stop request arrived inside an interruptible block (a BaseException, so that the
    `except Exception` of the code it interrupts, a model loader's, does not swallow it)."""


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


def request_stop(stop: threading.Event) -> None:
    """Ask the run to stop: set `stop`; inside an interruptible block, also raise `Interrupted`."""
    stop.set()
    if _depth and _on_main_thread():
        raise Interrupted
