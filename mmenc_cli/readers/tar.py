"""WebDataset tar shards as a manifest, read as a stream (never extracted to disk).

A sample is the run of consecutive members sharing a key: the member name up to the first dot of
its file name, folders included (`train/000123.jpg` -> key `train/000123`, suffix `jpg`; the
WebDataset rule). Image members are bytes; `txt` members are text; a `json` member's fields join
the record (for `--keep`, and `--id-key` to take the id from one of them). A member whose key
already ended earlier in the shard starts an orphan: one error row for its members. A member larger than
`--max-row-bytes` makes its sample one 413 row (its data is skipped, not read). A shard that is
empty, or truncated or corrupt from some byte on, keeps what was read and reports the rest as one
error row naming the shard and the byte offset; the run goes on with the next shard.

`offset` is the byte offset of the sample's first member header, `line` the member's 1-based
index in the shard: what `mmenc errors retry` rereads (`read_sample`).
"""

from __future__ import annotations

import json
import posixpath
import tarfile
import zlib
from typing import IO, Any, Iterator

from ..errors import MMError
from . import files
from .lines import Raw, row_too_large

#: suffixes whose members are text (decoded as UTF-8) or JSON
TEXT_SUFFIXES = ("txt", "text", "caption", "cls", "id")


def split_name(name: str) -> tuple[str, str] | None:
    """(key, suffix) of a member name, or None when its file name has no dot."""
    folder, base = posixpath.split(name)
    if "." not in base.lstrip("."):
        return None
    stem, suffix = base.split(".", 1) if not base.startswith(".") else (base, "")
    return posixpath.join(folder, stem) if folder else stem, suffix.lower()


def _bad(message: str, reason: str = "manifest.invalid_row") -> MMError:
    return MMError(message, stage="read", reason=reason)


class _Sample:
    """The members of one sample being gathered."""

    def __init__(self, key: str, offset: int, index: int) -> None:
        self.key, self.offset, self.index = key, offset, index
        self.record: dict[str, Any] = {"__key__": key}
        self.error: MMError | None = None

    def add(self, suffix: str, data: bytes) -> None:
        if suffix == "json":
            value = json.loads(data)
            if isinstance(value, dict):
                self.record = {**value, **self.record}
        elif suffix in TEXT_SUFFIXES:
            self.record[suffix] = data.decode("utf-8").strip()
        else:
            self.record[suffix] = data

    def raw(self) -> Raw:
        return self.index, self.offset, (None if self.error else self.record), self.error


def tar_records(path: str, limit: int) -> Iterator[Raw]:
    """Every sample of the shard at `path`, then (at worst) one error row for a damaged tail."""
    with files.open_binary(path) as fh:
        yield from _samples(fh, path, limit)


_DAMAGE = (tarfile.TarError, EOFError, OSError, zlib.error)


def _samples(fh: IO[bytes], path: str, limit: int) -> Iterator[Raw]:
    current: _Sample | None = None
    ended: set[str] = set()
    index = 0
    try:
        tf = tarfile.open(fileobj=fh, mode="r|*")
    except _DAMAGE as exc:
        yield _damaged(path, 0, 0, exc)
        return
    with tf:
        members = iter(tf)
        while True:
            try:
                member = next(members, None)
            except _DAMAGE as exc:  # the sample being read may lack members: lost with the rest
                yield _damaged(path, *((current.index, current.offset) if current else (index + 1, tf.offset)), exc)
                return
            if member is None:
                break
            index += 1
            if not member.isfile():
                continue
            parts = split_name(member.name)
            if parts is None:
                yield index, member.offset, None, _bad(f"{path}: member {member.name} has no suffix")
                continue
            if current is None or parts[0] != current.key:
                if current is not None:
                    ended.add(current.key)
                    yield current.raw()
                current = _start(path, member, index, parts[0], ended)
            try:
                _add_member(current, tf, member, parts[1], limit)
            except _DAMAGE as exc:  # its data cut short: the sample is lost with the rest
                yield _damaged(path, current.index, current.offset, exc)
                return
    if current is not None:
        yield current.raw()
    elif index == 0:
        yield 0, 0, None, _bad(f"{path} holds no samples (an empty tar)", "manifest.bad_shard")


def _start(path: str, member: tarfile.TarInfo, index: int, key: str, ended: set[str]) -> _Sample:
    """A new sample; one whose key ended earlier is an orphan, one error row for all its members."""
    sample = _Sample(key, member.offset, index)
    if key in ended:
        sample.error = _bad(f"{path}: member {member.name} belongs to sample {key}, which ended earlier: the "
                            "members of a sample must be consecutive")
    return sample


def _damaged(path: str, index: int, start: int, exc: BaseException) -> Raw:
    return index, start, None, _bad(f"{path} is truncated or corrupt from byte {start} on ({exc}): the samples "
                                    "from there to the end of the shard are lost", "manifest.bad_shard")


def _add_member(sample: _Sample, tf: tarfile.TarFile, member: tarfile.TarInfo, suffix: str, limit: int) -> None:
    """Read one member into its sample (or mark the sample too large or unreadable)."""
    if sample.error is not None:
        return
    if member.size > limit:
        sample.error = row_too_large(member.size, limit)
        return
    handle = tf.extractfile(member)
    data = handle.read() if handle is not None else b""
    try:
        sample.add(suffix, data)
    except (ValueError, UnicodeDecodeError) as exc:  # a txt that is not UTF-8, a json that is not JSON
        sample.error = _bad(f"member {member.name} cannot be read: {type(exc).__name__}: {exc}")


def read_sample(path: str, offset: int, limit: int) -> tuple[dict[str, Any] | None, MMError | None]:
    """The sample whose first member starts at `offset` (for `mmenc errors retry`)."""
    with files.open_binary(path) as fh:
        for _index, start, record, error in _samples(fh, path, limit):
            if start == offset:
                return record, error
    return None, _bad(f"{path} has no sample at byte {offset}: has the shard changed since the run?")
