"""Processes that die with the process that started them, where an engine asks for it.

A Ray worker that runs a task can be SIGKILLed at any moment (a cancel, a node being drained, the
test that proves resumption). The processes its encode run started must not outlive it: a device
worker would go on committing shards while Ray's retry of the same task starts elsewhere, and
decode workers and their forkserver would linger. Linux's `PR_SET_PDEATHSIG` has the kernel send a
signal to a process when its parent exits (strictly: the parent thread that started it; the encode
run starts its children from its own thread, which outlives them).

The engine's task calls `require()`: it sets `MMENC_DIE_WITH_PARENT=1` in its environment, which
every process it starts inherits, and each such process calls `inherit()` as it starts: device
workers (`run/devices.py`), the decode workers' forkserver (`lifeline_preload`, a preload of
`run/decode_pool.start_forkserver`) and the decode workers (`run/decode_worker.init_worker`, dying
with the forkserver, which dies with the encode process). Without the variable nothing changes:
a device worker whose parent is gone still commits its whole shards and exits, as it always did.
Elsewhere than Linux `inherit` does nothing (the decode workers' own watch of their parent remains).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

ENV = "MMENC_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent exits (Linux). With `parent`,
    the pid the parent had: a parent that is already gone ends this process at once. False where
    the platform cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:  # gone before the prctl: no signal will come
        os.kill(os.getpid(), sig)
    return True


def require() -> None:
    """Make every process started from now on by this one die with its parent (see the module docstring)."""
    os.environ[ENV] = "1"


def inherit(parent: int | None = None) -> bool:
    """In a process just started: die with the parent when the process that started it asked for it."""
    return os.environ.get(ENV) == "1" and die_with_parent(parent)
