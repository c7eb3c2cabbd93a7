"""Key files: what each committed shard holds, as hashes, so a resume, `status` and `inspect` never
open the shards themselves.

A shard's key file (`_mmenc/keys/<shard>.keys`) is written, complete, before the shard is
committed. It holds, per embedding: the hash of (id, modality), the hash of the id, the hash of the
row's source (its manifest and its place there: `ManifestRow.locator`), and the source itself (an
index into the shard's manifests, and the offset), so a duplicate id can be named with where it
was first encoded. 36 bytes a row on disk; `CommittedKeys` keeps 28 a row in memory.

A key file (version 2, `MMKEYS2`) ends with the SHA-256 of everything before it, and its head
records the SHA-256 of the shard's bytes (and of its sidecar or index) as committed, which
`mmenc inspect` checks. A key file that fails its checksum is ignored, as is a missing one: the
shard is read once the old way (its id and modality columns) and given a new key file, with its
sources unknown. A version-1 key file (`MMKEYS1`, an earlier mmenc's) has no checksum: its rows
are used only once they agree with the shard's own columns (`keyindex.py`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..idset import HashSet64, id_hash
from .outdir import OutDir

MAGIC = b"MMKEYS2\n"
MAGIC_V1 = b"MMKEYS1\n"  # no checksum
SEAL = 32  # bytes of the SHA-256 that ends a version-2 record
ROW = np.dtype([("item", "<u8"), ("id", "<u8"), ("src", "<u8"), ("man", "<u4"), ("off", "<i8")])
UNKNOWN = 0  # the source hash of a row whose source was not recorded


def key_rows(ids: Sequence[str], modalities: Sequence[str], sources: Sequence[tuple[str, str, int | None]] | None
             ) -> tuple[np.ndarray, list[str]]:
    """The key rows of a shard and its manifests; `sources` gives each row's (manifest, locator,
    offset), None when unknown. A row found by its key, not its offset, records offset -1."""
    rows = np.zeros(len(ids), dtype=ROW)
    rows["item"] = [id_hash(i, m) for i, m in zip(ids, modalities)]
    rows["id"] = [id_hash(i) for i in ids]
    manifests: dict[str, int] = {}
    if sources is not None:
        rows["src"] = [id_hash(man, loc) for man, loc, _ in sources]
        rows["man"] = [manifests.setdefault(man, len(manifests)) for man, _, _ in sources]
        rows["off"] = [off if off is not None and loc == str(off) else -1 for _, loc, off in sources]
    return rows, list(manifests)


@dataclass
class KeyRecord:
    """What a key file (or a pack's entry) says of its shard: its key rows and their manifests,
    the shard's size at commit (None: not recorded), the SHA-256 (hex) of its files at commit
    (`sums`: "shard", and "side" for its sidecar or index), and whether the record's own checksum
    held (`sealed`; False for a version-1 record, which has none)."""

    rows: np.ndarray
    manifests: list[str]
    size: int | None = None
    sums: dict[str, str] = field(default_factory=dict)
    sealed: bool = True


def seal(body: bytes) -> bytes:
    """A record's bytes: `body`, then the SHA-256 of `body`."""
    return body + hashlib.sha256(body).digest()


def unseal(data: bytes) -> bytes | None:
    """The body of sealed bytes; None when its SHA-256 does not hold (damaged, or cut)."""
    body = data[:-SEAL]
    if len(data) < SEAL or hashlib.sha256(body).digest() != data[-SEAL:]:
        return None
    return body


def file_sha256(path: Any) -> str:
    """The SHA-256 (hex) of a file's bytes, local or in a store (read in 8 MiB pieces)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def head_sums(head: dict[str, Any]) -> dict[str, str]:
    """The file checksums a record's JSON head holds (`sha256`: {"shard": hex, "side": hex})."""
    sums = head.get("sha256")
    return {str(k): str(v) for k, v in sums.items()} if isinstance(sums, dict) else {}


def encode_keys(record: KeyRecord) -> bytes:
    """A key file's bytes: the magic, a JSON line (manifests, row count, the shard's size in bytes
    and its files' SHA-256 when known), the rows, and the SHA-256 of all that."""
    head: dict[str, Any] = {"manifests": record.manifests, "rows": int(record.rows.size)}
    if record.size is not None:
        head["bytes"] = record.size
    if record.sums:
        head["sha256"] = record.sums
    rows = record.rows.astype(ROW, copy=False).tobytes()
    return seal(MAGIC + json.dumps(head, ensure_ascii=True).encode() + b"\n" + rows)


def read_keys(path: Any) -> KeyRecord | None:
    """A key file's record; None when the file is missing, not whole, or fails its checksum."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return parse_keys(data)


def parse_keys(data: bytes | None) -> KeyRecord | None:
    """`read_keys` of a key file's bytes (None: missing). A version-1 file is `sealed=False`."""
    if data is None:
        return None
    sealed = data.startswith(MAGIC)
    body = unseal(data) if sealed else data if data.startswith(MAGIC_V1) else None
    if body is None:
        return None
    end = body.find(b"\n", len(MAGIC))
    try:
        head = json.loads(body[len(MAGIC):end])
        rows = np.frombuffer(body, dtype=ROW, offset=end + 1)
        if rows.size != head.get("rows"):
            return None
        size = head.get("bytes")
        return KeyRecord(rows, [str(m) for m in head.get("manifests") or []],
                         int(size) if isinstance(size, int) else None, head_sums(head), sealed)
    except Exception:  # anything a damaged version-1 head makes of it (ValueError, AttributeError, ...)
        return None


@dataclass
class CommittedKeys:
    """The keys of every committed shard: (id, modality) done, and per id where it came from."""

    done: HashSet64 = field(default_factory=HashSet64)
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))  # sorted id hashes
    sources: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))  # their source hashes
    shard_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))  # index into `shards`
    shards: list[Path] = field(default_factory=list)
    key_paths: list[Path] = field(default_factory=list)
    repeated: int = 0  # (id, modality) pairs committed more than once: an item encoded twice

    @classmethod
    def build(cls, parts: Iterable[tuple[Path, Path, np.ndarray]]) -> "CommittedKeys":
        """From (shard, key file, key rows) of each shard: one sort for all."""
        shards, key_paths, rows = [], [], []
        for shard, key_path, part in parts:
            shards.append(shard)
            key_paths.append(key_path)
            rows.append(part)
        every = np.concatenate(rows) if rows else np.zeros(0, ROW)
        owner = np.repeat(np.arange(len(rows), dtype=np.uint32), [r.size for r in rows]) if rows else \
            np.zeros(0, np.uint32)
        order = np.argsort(every["id"], kind="stable")
        done = HashSet64(np.ascontiguousarray(every["item"]))
        return cls(done=done, ids=every["id"][order], sources=every["src"][order], shard_of=owner[order],
                   shards=shards, key_paths=key_paths, repeated=int(every.size) - len(done))

    def __len__(self) -> int:
        return int(self.ids.size)

    def other_source(self, row_id: str, source: int) -> tuple[int, int] | None:
        """(shard, source) of a committed row of `row_id` from a source other than `source`; None
        when the id is not committed, or came from `source`, or from a source not recorded."""
        h = np.uint64(id_hash(row_id))
        lo, hi = np.searchsorted(self.ids, h, "left"), np.searchsorted(self.ids, h, "right")
        if lo == hi:
            return None
        found = self.sources[lo:hi]
        if (found == np.uint64(source)).any() or (found == np.uint64(UNKNOWN)).any():
            return None
        return int(self.shard_of[lo]), int(found[0])

    def origin(self, shard: int, source: int) -> tuple[str | None, int, str]:
        """(manifest, offset, shard name) of a committed row of `shard` from `source`; the offset is
        -1 for a row found by its key (a folder's sample), the manifest None when not recorded."""
        name = self.shards[shard].name
        loaded = read_keys(self.key_paths[shard])
        if loaded is not None:
            hit = loaded.rows[loaded.rows["src"] == np.uint64(source)]
            if hit.size and int(hit["man"][0]) < len(loaded.manifests):
                return loaded.manifests[int(hit["man"][0])], int(hit["off"][0]), name
        return None, -1, name

    def duplicate_ids(self) -> np.ndarray:
        """The hashes of ids committed from more than one recorded source (two rows, one id)."""
        known = self.sources != np.uint64(UNKNOWN)
        if not known.any():
            return np.zeros(0, np.uint64)
        pairs = np.unique(np.stack([self.ids[known], self.sources[known]], axis=1), axis=0)
        return np.unique(pairs[1:, 0][pairs[1:, 0] == pairs[:-1, 0]]).astype(np.uint64)


def write_keys(out: OutDir, shard: str, record: KeyRecord) -> None:
    """Write a shard's key file (after the shard: a shard without one is read the old way), with
    the shard's size and checksums to check it by (OSError: a fault of the output)."""
    out.fs.publish(out.keys_path(shard), encode_keys(record))


def hashed(files: Any, sums: dict[str, str]) -> Any:
    """A shard's `writers.ShardFiles` whose functions, once they wrote a file (the local staged
    copy, before its commit), put its SHA-256 in `sums` ("shard", "side")."""
    from dataclasses import replace

    def wrap(write: Any, key: str) -> Any:
        def write_and_hash(path: Path) -> None:
            write(path)
            sums[key] = file_sha256(Path(path))
        return None if write is None else write_and_hash

    return replace(files, shard=wrap(files.shard, "shard"), sidecar=wrap(files.sidecar, "side"),
                   index=wrap(files.index, "side"))  # a shard has one side file at most
