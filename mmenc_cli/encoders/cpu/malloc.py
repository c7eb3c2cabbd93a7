"""glibc's malloc told to keep freed tensor memory for reuse (Linux with glibc only)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger("mmenc")

#: glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


_MALLOC_SET: list[bool] = []


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to reuse freed tensor memory instead of returning it to the kernel.

    CPU tensors of a forward pass (activations of a batch: a few MB each) are allocated and freed
    by the hundred per batch. glibc serves blocks above its mmap threshold with fresh `mmap`s and
    gives them back on free, so each one page-faults again on first touch; its threshold adapts
    only to sizes it has already seen, which with batches sorted by length (growing shapes) are
    always new. With the threshold at its documented maximum (32 MiB on 64-bit) and the heap
    trimmed only above 1 GiB freed, activations are recycled: the fresh-process slow start of the first pass over the shapes is
    gone (PyTorch's CPU tuning guides swap in jemalloc/tcmalloc for the same reason). Peak memory
    is unchanged: what is kept is what the largest batch needed anyway.

    Linux with glibc only; once per process; skipped when the user tunes malloc already (any
    `MALLOC_*` variable, `glibc.malloc.*` in `GLIBC_TUNABLES`) or sets `MMENC_MALLOC=0`. Returns whether the settings were applied.
    """
    if _MALLOC_SET:
        return _MALLOC_SET[0]
    applied = False
    user_tuned = (any(k.startswith("MALLOC_") for k in os.environ)
                  or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))
    if sys.platform.startswith("linux") and not user_tuned and os.environ.get("MMENC_MALLOC", "1") != "0":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            applied = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
        except (OSError, AttributeError) as exc:  # musl and other libcs have no mallopt
            log.debug("mallopt unavailable: %s", exc)
    _MALLOC_SET.append(applied)
    return applied
