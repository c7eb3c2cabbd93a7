"""A tar archive as a stream of members and damaged spans, never taking damage for the end.

Python's `tarfile` in stream mode takes a truncated header, a header with a bad checksum or a
zero block anywhere as the end of the archive, so the members after it vanish without a word.
This reader parses the headers itself (`tarfile.TarInfo.frombuf` checks each block) and tells
apart:

- the end-of-archive marker (zero blocks): read on past it, so concatenated tars (`cat a.tar
  b.tar`) are read whole; only all-zero blocks are skipped silently;
- a damaged span: a block that is not a header where one must be. The bytes are skipped block by
  block to the next valid header (or the end), and the span is yielded as a `Damage` with the
  name the damaged header seems to hold;
- a cut: the stream ends inside a header or a member's data, or ends without the end-of-archive
  marker, or a compressed stream fails to decompress. Nothing after it can be read: a final
  `Damage` with no end.

GNU long names (`L`, `K`) and pax headers (`x`: path, linkpath, size) are applied to the member
they precede; a member's `offset` is its first header's (an extended header's, when it has one),
the offset `tarfile` gives. gzip, bzip2 and xz streams are decompressed on the fly; offsets are
then positions in the uncompressed tar.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import tarfile
import zlib
from dataclasses import dataclass
from typing import IO, Iterator

BLOCK = 512
_ZERO = bytes(BLOCK)
_OCTAL = b"01234567 \x00"
_KINDS = {tarfile.REGTYPE: "file", tarfile.AREGTYPE: "file", tarfile.CONTTYPE: "file", tarfile.LNKTYPE: "hardlink",
          tarfile.SYMTYPE: "symlink", tarfile.DIRTYPE: "dir"}
_OTHER = {tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a FIFO",
          tarfile.GNUTYPE_SPARSE: "a sparse file"}
#: member types whose header is followed by no data
_NO_DATA = (tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.DIRTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE)
_EXTENDED = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
             tarfile.SOLARIS_XHDTYPE)
#: a read of a compressed stream that fails: the rest cannot be reached
_STREAM_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError, ValueError)


@dataclass(slots=True)
class Member:
    """One archive member: `kind` is "file", "hardlink", "symlink", "dir" or "other" (`what`
    says which); `offset` its first header's byte, `data` its data's, `index` its 1-based place."""

    name: str
    kind: str
    offset: int
    data: int
    size: int
    link: str
    index: int
    what: str = ""


@dataclass(slots=True)
class Damage:
    """Bytes that are not tar: `end` is where a valid header was found again (None: nothing after
    `start` can be read); `names` the member names its damaged headers seem to hold, `exact` whether
    each still names its member and, by their sizes, they fill the span; `after_end` whether it follows
    an end-of-archive marker (so no member before it was cut)."""

    start: int
    end: int | None
    cause: str
    names: tuple[str, ...] = ()
    exact: bool = False
    after_end: bool = False


class Cut(Exception):
    """A member's data ends early (the stream was cut or failed to decompress)."""

    def __init__(self, at: int, cause: str) -> None:
        super().__init__(cause)
        self.at, self.cause = at, cause


def open_tar_stream(fh: IO[bytes]) -> IO[bytes]:
    """The uncompressed tar behind `fh` (gzip, bzip2 and xz told by their magic bytes)."""
    head = fh.read(6)
    fh.seek(0)
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[return-value]
    if head.startswith(b"BZh"):
        return bz2.BZ2File(fh)  # type: ignore[return-value]
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(fh)  # type: ignore[return-value]
    return fh


class TarStream:
    """Iterate `Member`s and `Damage`s of one tar stream; `read(member)` reads the data of the
    member just yielded (what is not read is skipped when the iteration goes on)."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.pos = 0  # bytes of the tar consumed
        self.index = 0
        self._data_end = 0  # where the current member's data (with padding) ends
        self._back = b""  # bytes read ahead while looking for a header, to be read again

    # -- reading ------------------------------------------------------------------------------
    def _read(self, n: int) -> bytes:
        if self._back:
            data, self._back = self._back[:n], self._back[n:]
            if len(data) < n:
                data += self._read_fh(n - len(data))
        else:
            data = self._read_fh(n)
        self.pos += len(data)
        return data

    def _read_fh(self, n: int) -> bytes:
        try:
            return self.fh.read(n)
        except _STREAM_ERRORS as exc:
            raise Cut(self.pos, f"the stream cannot be decompressed: {type(exc).__name__}: {exc}") from None

    def _skip_to(self, end: int) -> None:
        while self.pos < end:
            got = self._read(min(end - self.pos, 1 << 20))
            if not got:
                raise Cut(self.pos, f"the data ends at byte {self.pos}, before byte {end}")

    def read(self, member: Member) -> bytes:
        """The data of `member` (the one just yielded); `Cut` when the stream ends early."""
        if self.pos != member.data:
            raise ValueError(f"member {member.name}'s data has been read past")
        data = self._read(member.size)
        if len(data) < member.size:
            raise Cut(member.offset, f"member {member.name} is cut: {len(data)} of its {member.size} bytes")
        return data

    # -- iteration ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Member | Damage]:
        zeros, zero_at = 0, 0  # zero blocks in a row since the last member, and where they began
        while True:
            try:
                if self.pos < self._data_end:
                    self._skip_to(self._data_end)
                start, block = self.pos, self._read(BLOCK)
            except Cut as cut:
                yield Damage(cut.at, None, cut.cause)
                return
            if len(block) < BLOCK and not block.strip(b"\x00"):  # the end, or a cut in the zero padding
                if not zeros and start > 0:
                    yield Damage(start, None, f"the shard ends at byte {start} without tar's end-of-archive marker")
                return
            if len(block) < BLOCK:
                yield Damage(start, None, f"a header is cut at byte {start + len(block)}", after_end=zeros > 1)
                return
            if block == _ZERO:
                zero_at, zeros = (start if not zeros else zero_at), zeros + 1
                continue
            lone = zero_at if zeros == 1 else None  # one zero block is no end-of-archive marker: a blanked header
            if not (yield from self._members_from(start, block, zeros > 1, lone)):
                return
            zeros = 0

    def _members_from(self, start: int, block: bytes, ended: bool, lone: int | None) -> Iterator[Member | Damage]:
        """Yield the member whose first header is `block`, or the damaged span there and the member
        after it; False when nothing more can be read."""
        while True:
            info = _header(block)
            member = None
            if info is not None:
                try:
                    member = self._resolve(start, info)
                except Cut as cut:
                    yield Damage(start, None, cut.cause, after_end=ended)
                    return False
            if member is not None:
                if lone is not None:
                    yield Damage(lone, start, f"a zero block at byte {lone} where a header should be")
                yield member
                return True
            cause = "a header with a bad checksum" if info is None else "an extended header that cannot be read"
            at = start
            if lone is not None:
                cause, at = f"a zero block where a header should be, then {cause}", lone
            found = yield from self._resync(at, block, f"{cause} at byte {at}", ended,
                                            _ZERO if lone is not None else block)
            if found is None:
                return False
            (start, block), ended, lone = found, False, None

    def _resync(self, start: int, block: bytes, cause: str, ended: bool, first: bytes) -> Iterator[Damage]:
        """Look for the next valid header after a damaged one (at any byte: bytes may have been
        inserted or lost); yield the damaged span with the names its damaged headers hold (`first`:
        the block where a header should have been); return (offset, block) of that header, or None."""
        heads = [(start, first)]  # the damaged headers of the span: where, and their block
        window, base = block, self.pos - len(block)  # bytes read from `base` on
        checked = 1  # window positions before this one are not headers
        while True:
            found, suspects = _find_header(window, checked)
            heads += [(base + p, window[p:p + BLOCK]) for p in suspects]
            names = [_name_hint(b) for _, b in heads]
            known = tuple(n for n in names if n is not None)
            if found is not None:
                self._back = window[found + BLOCK:] + self._back
                at = base + found
                self.pos = at + BLOCK
                exact = len(known) == len(names) and _chained(heads, at)
                yield Damage(start, at, f"{cause}: bytes {start} to {at} are not tar members", known, exact, ended)
                return at, window[found:found + BLOCK]
            try:
                more = self._read(1 << 16)
            except Cut as cut:
                yield Damage(start, None, f"{cause}; {cut.cause}", known, False, ended)
                return None
            if not more:
                yield Damage(start, None, f"{cause}, and no valid header after it", known, False, ended)
                return None
            keep = max(0, len(window) - BLOCK)
            window, base, checked = window[keep:] + more, base + keep, max(1, len(window) - keep - BLOCK + 1)

    def _resolve(self, start: int, info: tarfile.TarInfo) -> Member | None:
        """Apply extended headers (GNU long names, pax path, linkpath and size) to the member they
        precede; None when a header after one is damaged."""
        name = link = None
        size: int | None = None
        while info.type in _EXTENDED:
            data = self._extended_data(info)
            if info.type == tarfile.GNUTYPE_LONGNAME:
                name = _text(data.split(b"\x00", 1)[0])
            elif info.type == tarfile.GNUTYPE_LONGLINK:
                link = _text(data.split(b"\x00", 1)[0])
            elif info.type != tarfile.XGLTYPE:
                fields = _pax(data)
                name, link = fields.get("path", name), fields.get("linkpath", link)
                size = int(fields["size"]) if fields.get("size", "").isdigit() else size
            block = self._read(BLOCK)
            if len(block) < BLOCK:
                raise Cut(start, f"the header after an extended header at byte {start} is cut")
            nxt = _header(block)
            if nxt is None:
                return None
            info = nxt
        return self._member_of(start, info, name or info.name, link or info.linkname,
                               info.size if size is None else size)

    def _member_of(self, start: int, info: tarfile.TarInfo, name: str, link: str, size: int) -> Member:
        self.index += 1
        kind = _KINDS.get(info.type, "other")
        data = self.pos
        stored = size if kind == "file" or info.type not in _NO_DATA else 0  # what tarfile skips too
        self._data_end = data + -(-stored // BLOCK) * BLOCK
        what = _OTHER.get(info.type, f"of tar type {info.type!r}") if kind == "other" else ""
        return Member(name, kind, start, data, size if kind == "file" else 0, link, self.index, what)

    def _extended_data(self, info: tarfile.TarInfo) -> bytes:
        data = self._read(info.size)
        if len(data) < info.size:
            raise Cut(self.pos, f"an extended header's data is cut at byte {self.pos}")
        self._read(-info.size % BLOCK)
        return data

def _find_header(window: bytes, first: int) -> tuple[int | None, list[int]]:
    """The first position from `first` in `window` where a whole valid header lies: block-aligned
    ones (the window starts block-aligned in the tar) or ustar ones anywhere; and the positions
    before it of blocks that look like headers but fail (damaged headers inside the span)."""
    size = len(window)
    candidates = set(range(-(-first // BLOCK) * BLOCK, size - BLOCK + 1, BLOCK))
    marked = set()
    at = window.find(b"ustar", first + 257)
    while at >= 0 and at - 257 <= size - BLOCK:
        marked.add(at - 257)
        at = window.find(b"ustar", at + 1)
    suspects = []
    for pos in sorted(candidates | marked):
        block = window[pos:pos + BLOCK]
        if block == _ZERO:
            continue
        if _header(block) is not None:
            return pos, suspects
        if pos in marked or _looks_like_header(block):
            suspects.append(pos)
    return None, suspects


def _looks_like_header(block: bytes) -> bool:
    """A block that is a damaged header rather than data, by its numeric fields (octal text)."""
    fields = (block[100:108], block[124:136], block[148:156])
    return block[0] != 0 and all(not f.translate(None, _OCTAL) and f.strip(b" \x00") for f in fields)


def _header(block: bytes) -> tarfile.TarInfo | None:
    """The header in one block, or None when its checksum (or its form) is wrong."""
    if block[148:156].translate(None, _OCTAL):  # the checksum field must be octal: a cheap first test
        return None
    try:
        return tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return None


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, str]:
    """The records of a pax extended header (`LEN key=value\\n` each)."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            break
        record = data[space + 1:pos + length - 1]
        key, _, value = record.partition(b"=")
        fields[_text(key)] = _text(value)
        pos += max(length, 1)
    return fields


def _chained(heads: list[tuple[int, bytes]], end: int) -> bool:
    """Whether damaged headers lead one to the next by their sizes, the last to `end`: then the
    span is those members and nothing else."""
    pos = heads[0][0]
    for at, block in heads:
        try:
            size = tarfile.nti(block[124:136])
        except (tarfile.HeaderError, ValueError):
            return False
        if at != pos or size < 0:
            return False
        pos += BLOCK + -(-size // BLOCK) * BLOCK
    return pos == end


def _name_hint(block: bytes) -> str | None:
    """The member name a damaged header seems to hold (its name field, when it reads as text)."""
    raw = block[:100].split(b"\x00", 1)[0]
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return name if name.isprintable() and name.strip() else None
