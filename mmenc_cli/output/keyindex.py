"""The keys of every committed shard, read for a resume, `status` and `inspect` without opening a
shard: from key packs, and from the key files of the shards no pack holds.

A key pack holds the key files of a runner's consecutive shards in one file, so a resume reads
one file for many shards instead of one a shard (in a bucket, one GET).

A pack repeats what its shards' key files hold (`keys.py`), written after them: every
`PACK_SHARDS` shards or `PACK_ROWS` rows, and when the task closes. The key file stays a shard's
record: a pack that is missing (a killed run's last shards), cut or unreadable only means that its
shards' key files are read, and a pack that cannot be written is no fault of the run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from ..errors import OutputError
from .keys import ROW, CommittedKeys, key_rows, parse_keys, write_keys
from .layout import parse_pack_name
from .outdir import OutDir, damaged_shard, shard_keys

log = logging.getLogger("mmenc")

MAGIC = b"MMPACK1\n"
PACK_SHARDS = 64  # shards a pack holds at most
PACK_ROWS = 1 << 20  # rows after which a pack is written (36 MiB of keys held at most)


@dataclass
class Packed:
    """One shard's keys in a pack: what its key file says."""

    name: str
    rows: np.ndarray
    manifests: list[str]
    size: int | None


def encode_pack(entries: Iterable[Packed]) -> bytes:
    """A pack's bytes: the magic, a JSON line (each shard's name, row count, manifests and size at
    commit), the rows of all its shards, one shard after another."""
    entries = list(entries)
    head = {"shards": [{"name": e.name, "rows": int(e.rows.size), "manifests": e.manifests, "bytes": e.size}
                       for e in entries]}
    body = b"".join(e.rows.astype(ROW, copy=False).tobytes() for e in entries)
    return MAGIC + json.dumps(head, ensure_ascii=True).encode() + b"\n" + body


def parse_pack(data: bytes | None) -> list[Packed] | None:
    """The shards of a pack's bytes; None when missing or not whole."""
    if data is None or not data.startswith(MAGIC):
        return None
    end = data.find(b"\n", len(MAGIC))
    try:
        shards = json.loads(data[len(MAGIC):end])["shards"]
        rows = np.frombuffer(data, dtype=ROW, offset=end + 1)
        counts = [int(s["rows"]) for s in shards]
        if sum(counts) != rows.size:
            return None
        out, at = [], 0
        for s, n in zip(shards, counts):
            size = s.get("bytes")
            out.append(Packed(str(s["name"]), rows[at:at + n], [str(m) for m in s.get("manifests") or []],
                              int(size) if isinstance(size, int) else None))
            at += n
    except Exception:  # anything a damaged header makes of it (ValueError, OverflowError, ...)
        return None
    return out


def load_packs(out: OutDir, committed: set[str], owner: tuple[int, int] | None = None) -> dict[str, Packed]:
    """Every packed shard's keys, by shard name (one listing, one read a pack). A pack that names
    a shard no longer `committed` (one deleted by hand, whose name its runner may give a new
    shard) is not used, and with `owner` (task, worker) that runner's such packs are removed,
    as are its packs that cannot be parsed: their shards' key files are read instead."""
    found: dict[str, Packed] = {}
    paths = out.pack_paths()
    for path, data in zip(paths, out.fs.read_many(paths)):
        shards = parse_pack(data)
        stale = shards is not None and any(s.name not in committed for s in shards)
        first = parse_pack_name(path.name)
        if owner is not None and first is not None and (first.task, first.worker) == owner \
                and (stale or (data is not None and shards is None)):
            _drop(out, path, must=stale)
        for shard in shards if shards is not None and not stale else []:
            found.setdefault(shard.name, shard)
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
        self.pending: list[Packed] = []
        self.rows = 0

    def add(self, name: str, rows: np.ndarray, manifests: list[str], size: int | None) -> None:
        """A shard committed with its key file: pack it (writing the pack once it is full)."""
        self.pending.append(Packed(name, rows, manifests, size))
        self.rows += int(rows.size)
        if len(self.pending) >= PACK_SHARDS or self.rows >= PACK_ROWS:
            self.flush()

    def flush(self) -> None:
        """Write what is pending as one pack (a failure is logged: the key files hold the same)."""
        if not self.pending:
            return
        entries, self.pending, self.rows = self.pending, [], 0
        try:
            self.out.fs.publish(self.out.pack_path(entries[0].name), encode_pack(entries))
        except OSError as exc:
            log.debug("key pack of %s not written: %s", entries[0].name, exc)


def packed_keys(packed: dict[str, Packed], name: str) -> tuple[Any, list[str], int | None] | None:
    """A shard's (rows, manifests, size) from the packs, as `keys.read_keys` gives them; None
    when no pack holds it."""
    entry = packed.get(name)
    return None if entry is None else (entry.rows, entry.manifests, entry.size)


def load_committed(out: OutDir, owner: tuple[int, int] | None = None) -> CommittedKeys:
    """The keys of every committed shard (`iter_key_rows`), in one structure."""
    return CommittedKeys.build(iter_key_rows(out, owner))


def iter_key_rows(out: OutDir, owner: tuple[int, int] | None = None,
                  damaged: list[str] | None = None) -> Iterator[tuple[Any, Any, np.ndarray]]:
    """(shard, key file, key rows) of every committed shard, from the packs and the key files of
    the shards no pack holds; a shard without either is read the old way (its sources unknown).
    `owner`, the (task, worker) of a run about to commit: shards without a key file are given
    one, so the next run reads them the new way, and the runner's stale packs are removed. Shards themselves
    are not opened (one listing gives their sizes): one whose size differs from the size its keys
    (or, in an older output, its shard log) recorded at commit is damaged: it raises
    `OutputError`, or with `damaged` is named there and left out."""
    from .shardlog import read_logs

    logged = {name: entry.get("bytes") for entries in read_logs(out).values() for name, entry in entries.items()}
    entries = out.shard_entries()
    packed = load_packs(out, {shard.name for shard, _ in entries}, owner)
    paths = [out.keys_path(shard.name) for shard, _ in entries]
    unpacked = out.fs.read_many([path for (shard, _), path in zip(entries, paths) if shard.name not in packed])
    for (shard, size), path in zip(entries, paths):
        loaded = packed_keys(packed, shard.name) or parse_keys(next(unpacked))
        expected = (loaded[2] if loaded is not None and loaded[2] is not None else logged.get(shard.name))
        if loaded is not None and expected not in (None, size):
            problem = damaged_shard(shard, ValueError(f"{size} bytes, committed with {expected}"))
            if damaged is None:
                raise OutputError(problem)
            damaged.append(problem)
            continue
        if loaded is None:
            found = shard_keys(out, shard, damaged)
            if found is None:
                continue
            rows, manifests = key_rows(*found, None)
            if owner is not None:
                try:
                    write_keys(out, shard.name, rows, manifests, size)
                except OSError:  # a read-only output still resumes, the old way
                    pass
            loaded = rows, manifests, size
        yield shard, path, loaded[0]
