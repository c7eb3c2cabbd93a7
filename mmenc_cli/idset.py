"""Compact sets of ids: 64-bit hashes in a sorted numpy array, about 8 bytes per member.

Resume and duplicate detection must remember every id of a run without a Python object per row.
New members go to a small Python set that is merged into the sorted array when it fills up, so
memory stays near 8 bytes a member (16 bytes briefly during a merge).
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np

_BUFFER = 1 << 16


def id_hash(*parts: str | None) -> int:
    """A stable 64-bit hash of one key (e.g. id, or id + modality); NUL-separated parts."""
    if len(parts) == 1 and parts[0] is not None:  # one id, a hash per row: no join
        data = parts[0].encode("utf-8", "surrogatepass")
    else:
        data = "\x00".join("" if p is None else p for p in parts).encode("utf-8", "surrogatepass")
    return int.from_bytes(_blake2b(data, digest_size=8).digest(), "little")


_blake2b = hashlib.blake2b


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """Sort and drop repeats (np.unique is many times slower than a sort on uint64)."""
    a = np.sort(a)
    if a.size > 1:
        keep = np.empty(a.size, dtype=bool)
        keep[0] = True
        np.not_equal(a[1:], a[:-1], out=keep[1:])
        a = a[keep]
    return a


class HashSet64:
    """A set of 64-bit hashes: a sorted uint64 array plus a small buffer of recent additions."""

    def __init__(self, hashes: Iterable[int] | np.ndarray = ()) -> None:
        arr = np.fromiter(hashes, dtype=np.uint64) if not isinstance(hashes, np.ndarray) else hashes
        self._sorted = _sorted_unique(arr.astype(np.uint64, copy=False))
        self._buffer: set[int] = set()

    def __len__(self) -> int:
        return int(self._sorted.size) + len(self._buffer)

    def __contains__(self, h: int) -> bool:
        if h in self._buffer:
            return True
        arr = self._sorted
        if arr.size == 0:
            return False
        i = int(np.searchsorted(arr, np.uint64(h)))
        return i < arr.size and int(arr[i]) == h

    def add(self, h: int) -> bool:
        """Add a hash; return False when it was already a member."""
        if h in self:
            return False
        self._buffer.add(h)
        # the buffer grows with the set (~1 byte/member), so merges stay O(n) each and few (amortized)
        if len(self._buffer) >= max(_BUFFER, self._sorted.size // 64):
            self._merge()
        return True

    def update(self, hashes: np.ndarray) -> None:
        """Add many hashes at once (e.g. the ids of a committed shard)."""
        self._merge(np.asarray(hashes, dtype=np.uint64))

    def _merge(self, extra: np.ndarray | None = None) -> None:
        new = np.fromiter(self._buffer, dtype=np.uint64, count=len(self._buffer))
        if extra is not None:
            new = np.concatenate([new, extra])
        new = _sorted_unique(new)
        old = self._sorted
        if old.size and new.size:
            idx = np.searchsorted(old, new)
            present = (idx < old.size) & (old[np.minimum(idx, old.size - 1)] == new)
            self._sorted = np.insert(old, idx[~present], new[~present])  # one linear merge, no re-sort
        elif new.size:
            self._sorted = new
        self._buffer.clear()

    def to_array(self) -> np.ndarray:
        """All members, sorted."""
        self._merge()
        return self._sorted

    @property
    def nbytes(self) -> int:
        """Approximate memory held (the buffer counted at ~64 bytes per entry)."""
        return int(self._sorted.nbytes) + 64 * len(self._buffer)


def hash_many(*columns: Iterable[str | None]) -> np.ndarray:
    """Hash zipped key columns (e.g. ids and modalities) into a uint64 array."""
    return np.fromiter((id_hash(*parts) for parts in zip(*columns)), dtype=np.uint64)


class AttemptCounts:
    """The highest attempt number recorded per 64-bit key: two sorted numpy arrays, 12 bytes a key.

    Built once from the error history (`add` while reading, then `freeze`); `get` is a binary search.
    """

    def __init__(self) -> None:
        from array import array

        self._new_keys, self._new_attempts = array("Q"), array("I")
        self._keys = np.zeros(0, np.uint64)
        self._attempts = np.zeros(0, np.uint32)

    def add(self, key: int, attempt: int) -> None:
        self._new_keys.append(key)
        self._new_attempts.append(max(0, min(attempt, 2**32 - 1)))

    def freeze(self) -> "AttemptCounts":
        """Fold the added pairs into the sorted arrays (max attempt per key)."""
        if not self._new_keys:
            return self
        keys = np.concatenate([self._keys, np.frombuffer(self._new_keys, dtype=np.uint64)])
        attempts = np.concatenate([self._attempts, np.frombuffer(self._new_attempts, dtype=np.uint32)])
        order = np.lexsort((attempts, keys))  # by key, then attempt: the last of each key is its max
        keys, attempts = keys[order], attempts[order]
        last = np.ones(keys.size, dtype=bool)
        np.not_equal(keys[1:], keys[:-1], out=last[:-1])
        self._keys, self._attempts = keys[last], attempts[last]
        del self._new_keys[:], self._new_attempts[:]
        return self

    def get(self, key: int) -> int:
        """The highest attempt recorded for `key`, 0 when none."""
        self.freeze()
        i = int(np.searchsorted(self._keys, np.uint64(key)))
        return int(self._attempts[i]) if i < self._keys.size and int(self._keys[i]) == key else 0

    def __len__(self) -> int:
        return int(self.freeze()._keys.size)
