"""Clips behind `http(s)://` URLs read in ranges: PyAV asks for the bytes it decodes, and only
those blocks are fetched (HTTP Range requests, each with the fetch's own timeout and retries).

A server that does not serve ranges answers 200 with the whole body: that body is the file (one
fetch, as an image's, bounded by the medium's `--max-*-bytes`). One that does not say the
resource's size, or answers another range than asked, gets one whole fetch instead. A block that
arrives short is completed with further requests. A block that cannot be fetched fails the item
once: its error is kept and raised again at once on every later read (PyAV retries reads).
"""

from __future__ import annotations

import collections
import io
from dataclasses import dataclass
from typing import Any

from ..config import MediaConfig
from ..errors import MMError
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
        self.failed: MMError | None = None  # the error of a block that could not be fetched
        self._block(0)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence not in (io.SEEK_SET, io.SEEK_CUR, io.SEEK_END):
            raise ValueError(f"invalid whence {whence}")
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
        if self.failed is not None:
            raise self.failed
        if self.whole is not None:
            return self.whole[index * BLOCK:(index + 1) * BLOCK]
        if index in self.blocks:
            self.blocks.move_to_end(index)
            return self.blocks[index]
        try:
            data = self._fetch(index)
        except MMError as exc:
            self.failed = exc
            raise
        if self.whole is not None:
            return self._block(index)
        self.blocks[index] = data
        if len(self.blocks) > CACHED:
            self.blocks.popitem(last=False)
        return data

    def _fetch(self, index: int) -> bytes:
        """Block `index` from the server (in several requests when one answers short); sets
        `whole` instead when the file comes whole."""
        clip, start = self.clip, index * BLOCK
        parts: list[bytes] = []
        want = BLOCK
        while want > 0:
            try:
                data, total, partial = http.fetch_range(clip.url, clip.cfg, clip.backoff, start, want)
            except http.NoRanges:  # a range other than asked: not to be trusted
                data, total, partial = b"", None, True
            if not partial or total is None:
                self.whole = data if not partial else http.fetch(clip.url, clip.cfg, clip.backoff)[0]
                self.size = len(self.whole)
                return b""
            self.size = total
            if not data:
                raise MMError(f"{clip.shown} sent no bytes from {start} of {total}", stage="load",
                              reason="remote.unavailable")
            parts.append(data)
            start += len(data)
            want = min(want - len(data), total - start)
        return b"".join(parts)
