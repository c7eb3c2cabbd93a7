"""Shared-memory slots: decoded pixels travel from the decode workers without pickling.

The encode process owns one shared-memory segment cut into fixed-size slots, one per image (or
video frame) that may be in flight or waiting for its batch. It hands a free slot to each image
it submits (a slot per sampled frame to a video clip); the worker writes the uint8 pixels there
and answers with a small descriptor (slot, shape); the encode process reads the pixels in place
and frees the slot once the batch has been copied out. Only the encode process creates and unlinks the segment, so a worker that dies
leaves nothing behind, and Python's resource tracker unlinks it if the encode process is killed.
Pixels that do not fit a slot (or any float32 model input) travel pickled, as before.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

log = logging.getLogger("mmenc")

#: the segment's name prefix: `ls /dev/shm/mmenc-*` shows a live run's segment
PREFIX = "mmenc-"


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a worker put one image's pixels: slot `index` of the segment, and their shape."""

    index: int
    shape: tuple[int, ...]


class SlotPool:
    """`count` slots of `slot_bytes` each in one segment, owned by the creating process."""

    def __init__(self, count: int, slot_bytes: int) -> None:
        self.count, self.slot_bytes = count, slot_bytes
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        size = max(1, count * slot_bytes)
        shm = shared_memory.SharedMemory(name, create=True, size=size)
        try:
            _reserve(shm, size)
        except OSError:
            shm.close()
            shm.unlink()
            raise
        self.shm: shared_memory.SharedMemory | None = shm
        self.name = shm.name
        self._free = list(range(count - 1, -1, -1))

    def acquire(self) -> int | None:
        """A free slot, or None when all are taken (the image then travels pickled)."""
        return self._free.pop() if self._free else None

    def release(self, index: int | None) -> None:
        if index is not None:
            self._free.append(index)

    @property
    def free(self) -> int:
        return len(self._free)

    def view(self, slot: Slot) -> np.ndarray:
        """The slot's pixels, in place (valid until the slot is released)."""
        assert self.shm is not None
        return np.ndarray(slot.shape, dtype=np.uint8, buffer=self.shm.buf, offset=slot.index * self.slot_bytes)

    def close(self) -> None:
        """Unlink the segment. The mapping stays until the process ends: a payload may still hold
        a view into it (a batch dropped at a stop), and reading an unmapped view would crash."""
        if self.shm is None:
            return
        shm, self.shm = self.shm, None
        _RETIRED.append(shm)
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


#: segments unlinked but still mapped (see `SlotPool.close`)
_RETIRED: list[shared_memory.SharedMemory] = []


def _reserve(shm: shared_memory.SharedMemory, size: int) -> None:
    """Allocate the segment's pages now: a sparse segment would let several device processes or
    tasks promise more than /dev/shm holds, and a worker writing past it dies of SIGBUS. OSError
    (ENOSPC) when it does not fit."""
    fd = getattr(shm, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, size)


class SlotWriter:
    """Worker side: attaches to the encode process's segment once, writes pixels into slots."""

    def __init__(self, name: str, slot_bytes: int) -> None:
        self.name, self.slot_bytes = name, slot_bytes
        self._shm: shared_memory.SharedMemory | None = None

    def write(self, index: int, pixels: np.ndarray) -> Slot | None:
        """Copy uint8 `pixels` into slot `index`; None when they are not uint8 or do not fit."""
        if pixels.dtype != np.uint8 or pixels.nbytes > self.slot_bytes:
            return None
        if self._shm is None:
            self._shm = attach(self.name)
        dest = np.ndarray(pixels.shape, dtype=np.uint8, buffer=self._shm.buf, offset=index * self.slot_bytes)
        dest[...] = pixels
        return Slot(index, tuple(pixels.shape))


def attach(name: str) -> Any:
    """Open the encode process's segment. Before Python 3.13 this registers it with the resource
    tracker, which a forkserver worker shares with the encode process (its fd is passed on): one
    entry, removed by the owner's unlink, so the worker never unlinks it on exit."""
    try:
        return shared_memory.SharedMemory(name, track=False)  # type: ignore[call-arg]  # Python >= 3.13
    except TypeError:
        return shared_memory.SharedMemory(name)


def shm_slots(count: int, slot_bytes: int | None) -> SlotPool | None:
    """A pool of up to `count` slots, at most half of `/dev/shm`'s free space and allocated at once
    (a container's small `/dev/shm` would otherwise end in SIGBUS on a worker's write); None when
    sizes vary, nothing fits or the segment cannot be made (pixels then travel pickled)."""
    if count <= 0 or not slot_bytes:
        return None
    try:
        st = os.statvfs("/dev/shm")
        count = min(count, int(st.f_bavail * st.f_frsize * 0.5) // slot_bytes)
    except OSError:  # no /dev/shm (macOS): the system's own limits apply
        pass
    if count <= 0:
        log.debug("shared memory: /dev/shm too small for one %d-byte slot; pixels travel pickled", slot_bytes)
        return None
    try:
        return SlotPool(count, slot_bytes)
    except OSError as exc:
        log.debug("shared memory unavailable (%s); pixels travel pickled", exc)
        return None
