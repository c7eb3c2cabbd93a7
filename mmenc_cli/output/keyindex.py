"""The keys of every committed shard, read for a resume, `status` and `inspect` without opening a
shard: from key packs, and from the key files of the shards no pack holds.

A key pack holds the key files of a runner's consecutive shards in one file, so a resume reads
one file for many shards instead of one a shard (in a bucket, one GET).

A pack repeats what its shards' key files hold (`keys.py`), written after them: every
`PACK_SHARDS` shards or `PACK_ROWS` rows, and when the task closes. The key file stays a shard's
record: a pack that is missing (a killed run's last shards), cut, unreadable or fails its checksum
(a pack ends with the SHA-256 of all before it), and an earlier mmenc's pack (`MMPACK1`, which has
no checksum), only mean that its shards' key files are read, and a pack that cannot be written is
no fault of the run. A record is never trusted unchecked: what a resume skips, and the duplicates
`status` and `inspect` count, come from records whose checksum held or from the shards themselves.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable, Iterator

import numpy as np

from ..errors import OutputError
from .keys import MAGIC as KEYS_MAGIC, ROW, CommittedKeys, KeyRecord, head_sums, key_rows, parse_keys, seal, \
    unseal, write_keys
from .layout import parse_pack_name
from .outdir import OutDir
from .shard_ids import damaged_shard, shard_keys

log = logging.getLogger("mmenc")

MAGIC = b"MMPACK2\n"  # version 1 (no checksum) is not read: its key files are
PACK_SHARDS = 64  # shards a pack holds at most
PACK_ROWS = 1 << 20  # rows after which a pack is written (36 MiB of keys held at most)


def encode_pack(entries: Iterable[tuple[str, KeyRecord]]) -> bytes:
    """A pack's bytes: the magic, a JSON line (each shard's name, row count, manifests, size and
    checksums at commit), the rows of all its shards, one shard after another, and the SHA-256 of
    all that."""
    entries = list(entries)
    head = {"shards": [{"name": name, "rows": int(r.rows.size), "manifests": r.manifests, "bytes": r.size,
                        "sha256": r.sums} for name, r in entries]}
    body = b"".join(r.rows.astype(ROW, copy=False).tobytes() for _, r in entries)
    return seal(MAGIC + json.dumps(head, ensure_ascii=True).encode() + b"\n" + body)


def parse_pack(data: bytes | None) -> list[tuple[str, KeyRecord]] | None:
    """The (shard name, record) of a pack's bytes; None when missing, not whole, failing its
    checksum, or of version 1."""
    body = unseal(data) if data is not None and data.startswith(MAGIC) else None
    if body is None:
        return None
    end = body.find(b"\n", len(MAGIC))
    try:
        shards = json.loads(body[len(MAGIC):end])["shards"]
        rows = np.frombuffer(body, dtype=ROW, offset=end + 1)
        counts = [int(s["rows"]) for s in shards]
        if sum(counts) != rows.size:
            return None
        out, at = [], 0
        for s, n in zip(shards, counts):
            size = s.get("bytes")
            out.append((str(s["name"]), KeyRecord(rows[at:at + n], [str(m) for m in s.get("manifests") or []],
                                                  int(size) if isinstance(size, int) else None, head_sums(s))))
            at += n
    except Exception:  # anything a damaged header makes of it (ValueError, OverflowError, ...)
        return None
    return out


def load_packs(out: OutDir, committed: set[str], owner: tuple[int, int] | None = None) -> dict[str, KeyRecord]:
    """Every packed shard's keys, by shard name (one listing, one read a pack). A pack that names
    a shard no longer `committed` (one deleted by hand, whose name its runner may give a new
    shard) is not used, and with `owner` (task, worker) that runner's such packs are removed,
    as are its packs that cannot be parsed: their shards' key files are read instead."""
    found: dict[str, KeyRecord] = {}
    paths = out.pack_paths()
    for path, data in zip(paths, out.fs.read_many(paths)):
        shards = parse_pack(data)
        if shards is None and data is not None and data.startswith(MAGIC):
            log.warning("key pack %s is damaged (it fails its checksum): ignored, its shards' key files are read",
                        path)
        stale = shards is not None and any(name not in committed for name, _ in shards)
        first = parse_pack_name(path.name)
        if owner is not None and first is not None and (first.task, first.worker) == owner \
                and (stale or (data is not None and shards is None)):
            _drop(out, path, must=stale)
        for name, record in shards if shards is not None and not stale else []:
            found.setdefault(name, record)
    return found


def _drop(out: OutDir, path: Any, must: bool) -> None:
    """Remove a runner's pack; one that names a shard gone `must` go before the runner commits."""
    try:
        out.fs.remove(path)
    except OSError as exc:
        if must:
            raise OutputError(f"key pack {path} names a shard that is gone and cannot be removed "
                              f"({exc.strerror or exc}); remove it, then run again") from exc
        log.debug("key pack %s not removed: %s", path, exc)


class PackWriter:
    """Collects a runner's committed shards' keys and writes them as packs."""

    def __init__(self, out: OutDir) -> None:
        self.out = out
        self.pending: list[tuple[str, KeyRecord]] = []
        self.rows = 0

    def add(self, name: str, record: KeyRecord) -> None:
        """A shard committed with its key file: pack it (writing the pack once it is full)."""
        self.pending.append((name, record))
        self.rows += int(record.rows.size)
        if len(self.pending) >= PACK_SHARDS or self.rows >= PACK_ROWS:
            self.flush()

    def flush(self) -> None:
        """Write what is pending as one pack (a failure is logged: the key files hold the same)."""
        if not self.pending:
            return
        entries, self.pending, self.rows = self.pending, [], 0
        try:
            self.out.fs.publish(self.out.pack_path(entries[0][0]), encode_pack(entries))
        except OSError as exc:
            log.debug("key pack of %s not written: %s", entries[0][0], exc)


def load_committed(out: OutDir, owner: tuple[int, int] | None = None) -> CommittedKeys:
    """The keys of every committed shard (`iter_key_rows`), in one structure."""
    return CommittedKeys.build(iter_key_rows(out, owner))


def shard_records(out: OutDir, owner: tuple[int, int] | None = None
                  ) -> Iterator[tuple[Any, int, Any, KeyRecord | None]]:
    """(shard, size, key file, record) of every committed shard, in order (one listing): its record
    from the packs, else from its key file; None where neither holds one whose checksum holds (a
    version-1 key file's record comes with `sealed=False`)."""
    entries = out.shard_entries()
    packed = load_packs(out, {shard.name for shard, _ in entries}, owner)
    paths = [out.keys_path(shard.name) for shard, _ in entries]
    unpacked = out.fs.read_many([path for (shard, _), path in zip(entries, paths) if shard.name not in packed])
    for (shard, size), path in zip(entries, paths):
        record = packed.get(shard.name)
        if record is None:
            data = next(unpacked)
            record = parse_keys(data)
            if record is None and data is not None and data.startswith(KEYS_MAGIC):
                log.warning("key file %s is damaged (it fails its checksum): ignored, its shard is read instead", path)
        yield shard, size, path, record


def iter_key_rows(out: OutDir, owner: tuple[int, int] | None = None, damaged: list[str] | None = None,
                  sums: dict[str, dict[str, str]] | None = None) -> Iterator[tuple[Any, Any, np.ndarray]]:
    """(shard, key file, key rows) of every committed shard, from the packs and the key files of
    the shards no pack holds (`shard_records`); a shard without a sound record, or with a version-1
    one, is read the old way (`from_shard`). `owner`, the (task, worker) of a run about to commit:
    such shards are given a key file, so the next run reads them the new way, and the runner's
    stale and damaged packs are removed. Shards are not opened otherwise (one listing gives their
    sizes): one whose size differs from the size its record (or, in an older output, its shard
    log) recorded at commit is damaged: it raises `OutputError`, or with `damaged` is named there
    and left out. Their bytes are not hashed here: `sums` gets each shard's checksums at commit,
    by name, for `mmenc inspect` to check."""
    from .shardlog import read_logs

    logged = {name: entry.get("bytes") for entries in read_logs(out).values() for name, entry in entries.items()}
    for shard, size, path, record in shard_records(out, owner):
        expected = record.size if record is not None and record.size is not None else logged.get(shard.name)
        if record is not None and expected not in (None, size):
            problem = damaged_shard(shard, ValueError(f"{size} bytes, committed with {expected}"))
            if damaged is None:
                raise OutputError(problem)
            damaged.append(problem)
            continue
        if record is None or not record.sealed:
            record = from_shard(out, shard, size, record, owner, damaged)
            if record is None:
                continue
        if sums is not None:
            sums[shard.name] = record.sums
        yield shard, path, record.rows


def from_shard(out: OutDir, shard: Any, size: int, old: KeyRecord | None, owner: tuple[int, int] | None,
               damaged: list[str] | None) -> KeyRecord | None:
    """A shard's record from its own id and modality columns (`shard_ids.shard_keys`; None when it
    cannot be read and `damaged` names it). A version-1 record's rows, with their sources, are kept
    when they agree with the columns. With `owner` the record is written as the shard's key file."""
    found = shard_keys(out, shard, damaged)
    if found is None:
        return None
    rows, manifests = key_rows(*found, None)
    if old is not None and np.array_equal(old.rows["item"], rows["item"]) and np.array_equal(old.rows["id"], rows["id"]):
        rows, manifests = old.rows, old.manifests
    record = KeyRecord(rows, manifests, size)
    if owner is not None:
        try:
            write_keys(out, shard.name, record)
        except OSError:  # a read-only output still resumes, the old way
            pass
    return record
