"""Clips behind `http(s)://` URLs read in ranges: PyAV asks for the bytes it decodes, and only
those blocks are fetched (HTTP Range requests, each with the fetch's own timeout and retries).

A server that does not serve ranges (it answers 200 with the whole body), or does not say the
resource's size, gets one whole fetch instead, as an image gets (bounded by the medium's
`--max-*-bytes`).
"""

from __future__ import annotations

import collections
import io
from dataclasses import dataclass
from typing import Any

from ..config import MediaConfig
from . import http

#: bytes per range request, and how many blocks are kept (a decoder going back and forth)
BLOCK, CACHED = 1 << 20, 8


@dataclass(frozen=True)
class HttpClip:
    """A clip at an `http(s)://` URL, to be opened as a seekable file read in ranges."""

    url: str
    cfg: MediaConfig
    backoff: float
    shown: str

    def open(self) -> "RangedFile":
        """The file; its first block is fetched now (the size, or that ranges are not served)."""
        return RangedFile(self)


class RangedFile(io.RawIOBase):
    """A read-only, seekable file over HTTP ranges (see the module docstring)."""

    def __init__(self, clip: HttpClip) -> None:
        super().__init__()
        self.clip = clip
        self.pos = 0
        self.size = 0
        self.whole: bytes | None = None  # the body, when the server sent it whole
        self.blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._block(0)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        if self.pos >= self.size:
            return 0
        index, offset = divmod(self.pos, BLOCK)
        chunk = self._block(index)[offset:offset + len(buffer)]
        buffer[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)

    def _block(self, index: int) -> bytes:
        if self.whole is not None:
            return self.whole[index * BLOCK:(index + 1) * BLOCK]
        if index in self.blocks:
            self.blocks.move_to_end(index)
            return self.blocks[index]
        clip = self.clip
        try:
            data, total = http.fetch_range(clip.url, clip.cfg, clip.backoff, index * BLOCK, BLOCK)
        except http.NoRanges:
            total = None
        if total is None:  # no ranges, or no size said: the whole body, once
            self.whole = http.fetch(clip.url, clip.cfg, clip.backoff)[0]
            self.size = len(self.whole)
            self.blocks.clear()
            return self._block(index)
        self.size = total
        self.blocks[index] = data
        if len(self.blocks) > CACHED:
            self.blocks.popitem(last=False)
        return data
