"""The decode workers' board: which item of which chunk each worker is on, and since when.

When a worker ends (its watchdog ran out the item's deadline, or a decoder crashed it), the pool
breaks and every chunk in it fails; the board tells which item of a chunk had run its whole
deadline, so that item fails at once as 504 instead of being decoded alone for a second deadline.
One shared-memory segment of fixed records, one per chunk in flight (slot = token % capacity),
owned by the encode process: Python's resource tracker unlinks it if that process is killed.
"""

from __future__ import annotations

import os
import secrets
import struct
from multiprocessing import shared_memory
from typing import Any

from .shm import PREFIX, attach

#: a chunk's record: its token, the index in the chunk of the item being decoded, when that item
#: started (time.monotonic(): one clock for every process of the machine) and its deadline
_RECORD = struct.Struct("<qqdd")


class Board:
    """The encode process's side: makes the segment, reads a chunk's record."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        name = f"{PREFIX}board-{os.getpid()}-{secrets.token_hex(4)}"
        self.shm: Any = shared_memory.SharedMemory(name, create=True, size=self.capacity * _RECORD.size)
        self.shm.buf[:] = bytes(self.capacity * _RECORD.size)

    @property
    def address(self) -> tuple[str, int]:
        """What a worker needs to attach (`BoardWriter`)."""
        return self.shm.name, self.capacity

    def timed_out(self, token: int, ended: float) -> set[int]:
        """The items of chunk `token` that had run their whole deadline by `ended` (when the pool
        broke): ended by their watchdog, not killed with the pool."""
        chunk, index, started, deadline = _RECORD.unpack_from(self.shm.buf, (token % self.capacity) * _RECORD.size)
        return {index} if chunk == token and deadline and ended - started >= deadline else set()

    def close(self) -> None:
        if self.shm is not None:
            shm, self.shm = self.shm, None
            shm.close()
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


class BoardWriter:
    """A worker's side: attaches once, overwrites the record of the chunk it is on."""

    def __init__(self, name: str, capacity: int) -> None:
        self.capacity = capacity
        self.shm = attach(name)

    def write(self, token: int, *fields: Any) -> None:
        _RECORD.pack_into(self.shm.buf, (token % self.capacity) * _RECORD.size, *fields)
