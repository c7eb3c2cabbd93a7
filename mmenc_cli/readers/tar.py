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
index in the shard: what `mmenc errors retry` rereads (`read_sample`). Task slices: whole shards,
placed in the byte space by size.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any, Iterator

from ..config import ManifestConfig
from ..errors import MMError
from . import files
from .lines import Raw
from .registry import WHOLE, Format, Part, Record, Source, register
from .tarstream import Cut, Damage, Member, TarStream, open_tar_stream
from .validate import TAR_AUDIO, TAR_IMAGES, TAR_VIDEO, Keys, option_keys

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
        self.names: dict[str, str] = {}  # suffix -> the member that gave it

    def add(self, name: str, suffix: str, data: bytes) -> None:
        """Take one member's data under its suffix (json fields join the record)."""
        if suffix in self.names:
            self.error = _bad(f"sample {self.key} has two {suffix} members ({self.names[suffix]}, {name}): "
                              "one of them would be dropped")
            return
        self.names[suffix] = name
        try:
            if suffix == "json":
                value = json.loads(data)
                if isinstance(value, dict):
                    self.record = {**value, **self.record}
            elif suffix in TEXT_SUFFIXES:
                self.record[suffix] = data.decode("utf-8").strip()
            else:
                self.record[suffix] = data
        except (ValueError, UnicodeDecodeError) as exc:  # a txt that is not UTF-8, a json that is not JSON
            self.error = _bad(f"member {name} of sample {self.key} cannot be read: {type(exc).__name__}: {exc}")

    def fail(self, error: MMError) -> None:
        """Mark the whole sample failed (its later members are read past); the first error stays."""
        if self.error is None:
            self.error = error

    def raw(self) -> Raw:
        """The sample as a record; a failed one keeps its key (and json fields) for its error row."""
        return self.index, self.offset, self.record, self.error


def _bad_shard(message: str) -> MMError:
    return _bad(message, "manifest.bad_shard")


class _Shard:
    """One shard's members gathered into samples, with every damaged span accounted for: a span
    inside a sample fails that sample, a span between samples is a row of its own, and a cut loses
    the sample being read with the rest of the shard (one row)."""

    def __init__(self, path: str, limit: int) -> None:
        self.path, self.limit = path, limit
        self.current: _Sample | None = None
        self.ended: set[str] = set()  # keys of the samples already complete
        self.pending: Damage | None = None  # a damaged span not yet tied to a sample
        self.members = 0
        self.links = _Targets(path)

    def samples(self, fh: Any) -> Iterator[Raw]:
        """Every sample of the shard behind `fh`, and the rows of its damage."""
        try:
            stream = TarStream(open_tar_stream(fh))
            for event in stream:
                if isinstance(event, Damage):
                    if event.end is None:
                        yield from self._lost(event)
                        return
                    yield from self._flush_pending()
                    self.pending = event
                    continue
                self.members += 1
                yield from self._member(event, stream)
        except Cut as cut:  # a member's data ends early: its sample is lost with the rest
            yield from self._lost(Damage(cut.at, None, cut.cause))
            return
        finally:
            self.links.close()
        yield from self._flush_pending()
        if self.current is not None:
            yield self.current.raw()
        elif self.members == 0:
            yield 0, 0, None, _bad_shard(f"{self.path} holds no samples (an empty tar)")

    def _member(self, member: Member, stream: TarStream) -> Iterator[Raw]:
        if member.kind == "dir":
            return
        parts = split_name(member.name)
        if parts is None:
            yield member.index, member.offset, None, _bad(f"{self.path}: member {member.name} has no suffix")
            return
        key, suffix = parts
        yield from self._place(key, member)
        sample = self.current
        assert sample is not None
        if member.kind == "file":
            self.links.add(member)
        if sample.error is not None:
            return
        data = self._data(member, stream, sample)
        if data is not None:
            sample.add(member.name, suffix, data)

    def _place(self, key: str, member: Member) -> Iterator[Raw]:
        """Start a new sample at `member` unless it continues the current one, settling a damaged
        span just before it first."""
        damage, self.pending = self.pending, None
        rows, fail_next = self._settle(damage, key) if damage is not None else ([], False)
        current = self.current
        if current is None or key != current.key:
            if current is not None:
                self.ended.add(current.key)
                yield current.raw()
            self.current = self._start(member, key)
            if fail_next:
                assert damage is not None
                self.current.fail(self._damaged_sample(damage, key))
        yield from rows

    def _settle(self, damage: Damage, key: str | None) -> tuple[list[Raw], bool]:
        """Tie a damaged span to the samples it hit: when every damaged header in it still names
        one of its neighbours, those; otherwise both the sample before it (it may have lost its
        last members) and the one after it (`key`, None when no member follows: its first).
        Named samples that are neither neighbour get a row of their own. Returns those rows and
        whether the sample after the span failed."""
        current = self.current
        new = key is not None and (current is None or key != current.key)
        parts = [split_name(n) for n in damage.names]
        named = list(dict.fromkeys(p[0] for p in parts if p is not None))
        exact = damage.exact and None not in parts  # every damaged header names a sample
        before = current if current is not None and not damage.after_end else None
        others = [k for k in named if k != key and (before is None or k != before.key)]
        exact = exact and not others  # a name that is neither neighbour's may be a neighbour's, garbled
        hit_before = before is not None and (not new and key is not None or not exact or before.key in named)
        if hit_before:
            assert before is not None
            before.fail(self._damaged_sample(damage, before.key))
        hit_next = new and (not exact or key in named)
        rows = [self._span(damage, k) for k in others]
        if not (rows or hit_before or hit_next):
            rows.append(self._span(damage, None))
        return rows, hit_next

    def _start(self, member: Member, key: str) -> _Sample:
        """A new sample; one whose key ended earlier is an orphan, one error row for all its members."""
        sample = _Sample(key, member.offset, member.index)
        if key in self.ended:
            sample.fail(_bad(f"{self.path}: member {member.name} belongs to sample {key}, which ended earlier: "
                             "the members of a sample must be consecutive"))
        return sample

    def _data(self, member: Member, stream: TarStream, sample: _Sample) -> bytes | None:
        """A member's bytes (a link's: its target's), or None with the sample failed."""
        if member.kind == "other":
            sample.fail(_bad(f"member {member.name} of sample {sample.key} is {member.what}, not a file"))
            return None
        target = member if member.kind == "file" else self.links.resolve(member)
        if isinstance(target, str):
            sample.fail(_bad(f"member {member.name} of sample {sample.key} is a {member.kind} {target}"))
            return None
        if target.size > self.limit:
            sample.fail(MMError(f"member {member.name} of sample {sample.key} is {target.size} bytes, over "
                                f"--max-row-bytes {self.limit}; it was read past, not loaded", stage="read",
                                reason="manifest.row_too_large"))
            return None
        return stream.read(member) if target is member else self.links.read(target)

    def _damaged_sample(self, damage: Damage, key: str) -> MMError:
        return _bad_shard(f"{self.path}: sample {key} is incomplete: {damage.cause}{_named(damage)}")

    def _span(self, damage: Damage, key: str | None) -> Raw:
        """A row for a damaged span itself, naming the sample its headers name (when they do)."""
        record = {"__key__": key} if key is not None else None
        lost = f"sample {key} is lost" if key is not None else "the members there are lost"
        return None, damage.start, record, _bad_shard(f"{self.path}: {damage.cause}{_named(damage)}; {lost}")

    def _flush_pending(self) -> Iterator[Raw]:
        if self.pending is not None:
            damage, self.pending = self.pending, None
            yield from self._settle(damage, None)[0]

    def _lost(self, damage: Damage) -> Iterator[Raw]:
        """The end of what can be read: the sample being read (unless an end-of-archive marker
        closed it) is lost with the rest of the shard, one row."""
        yield from self._flush_pending()
        current, self.current = self.current, None
        if current is not None and damage.after_end:
            yield current.raw()
            current = None
        start = current.offset if current is not None else damage.start
        index = current.index if current is not None else (None if damage.after_end else self.members + 1)
        record = {"__key__": current.key} if current is not None else None
        yield index, start, record, _bad_shard(f"{self.path} is truncated or corrupt from byte {start} on "
                                               f"({damage.cause}): the samples from there to the end of the "
                                               "shard are lost")


def _named(damage: Damage) -> str:
    return f" (its damaged headers name {', '.join(damage.names)})" if damage.names else ""


class _Targets:
    """The file members read so far, by name (offset and size only: their bytes are read again
    by offset when a later link names them, through a second handle)."""

    _DEPTH = 16

    def __init__(self, path: str) -> None:
        self.path = path
        self.files: dict[str, Member] = {}
        self.links: dict[str, str] = {}  # symlink and hard-link names -> their target's name
        self._raw: Any = None
        self._fh: Any = None

    def add(self, member: Member) -> None:
        self.files[posixpath.normpath(member.name)] = member

    def resolve(self, link: Member) -> Member | str:
        """The file member a link leads to, or what is wrong with it (a phrase)."""
        name = posixpath.normpath(link.name)
        target = _link_target(link)
        if target is None:
            return f"to {link.link}, outside the shard"
        self.links[name] = target
        for _ in range(self._DEPTH):
            if target in self.files:
                self.files.setdefault(name, self.files[target])
                return self.files[target]
            if target not in self.links:
                return f"to {link.link}, which is not a file earlier in the shard"
            target = self.links[target]
        return f"to {link.link}, a chain of links too long (a loop?)"

    def read(self, target: Member) -> bytes:
        if self._fh is None:
            self._raw = files.open_binary(self.path)
            self._fh = open_tar_stream(self._raw)
        self._fh.seek(target.data)
        data = self._fh.read(target.size)
        if len(data) < target.size:
            raise Cut(target.offset, f"member {target.name} is cut when read again")
        return data

    def close(self) -> None:
        for fh in (self._fh, self._raw):
            if fh is not None:
                fh.close()


def _link_target(link: Member) -> str | None:
    """The normalized name a link points to inside the shard (None: outside it)."""
    if link.kind == "hardlink":
        return posixpath.normpath(link.link)
    if link.link.startswith("/"):
        return None
    target = posixpath.normpath(posixpath.join(posixpath.dirname(link.name), link.link))
    return None if target.startswith("../") or target == ".." else target


def tar_records(path: str, limit: int) -> Iterator[Raw]:
    """Every sample of the shard at `path`, then (at worst) one error row for a damaged tail."""
    with files.open_binary(path) as fh:
        yield from _Shard(path, limit).samples(fh)


def read_sample(path: str, offset: int, limit: int) -> tuple[dict[str, Any] | None, MMError | None]:
    """The sample whose first member starts at `offset` (for `mmenc errors retry`)."""
    for _index, start, record, error in tar_records(path, limit):
        if start == offset:
            return record, error
    return None, _bad(f"{path} has no sample at byte {offset}: has the shard changed since the run?")


class Tar(Format):
    """WebDataset shards (`.tar`, `.tar.gz`, `.tgz`): whole shards; a sample's id is its key, its
    image, audio and video the first member of their suffixes, its text the `txt` member."""

    name, extensions, slicing, rewritten = "tar", (".tar", ".tar.gz", ".tgz"), WHOLE, True

    def keys(self, cfg: ManifestConfig) -> Keys:
        """`__key__`, the image, audio and video suffixes in order, `txt` (or the options)."""
        return option_keys(cfg, "__key__", TAR_IMAGES, "txt", TAR_AUDIO, TAR_VIDEO)

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        """Every sample of the shard."""
        return tar_records(src.path, cfg.max_row_bytes)

    def position(self, src: Source, offset: int) -> int | None:
        """The sample's byte offset in a plain tar; in a compressed one offsets are the
        uncompressed stream's, so its progress is known when it ends."""
        return None if src.path.lower().endswith((".gz", ".tgz")) else offset

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        """The sample whose first member header is at byte `offset`."""
        return read_sample(path, offset, limit)


TAR = register(Tar())
