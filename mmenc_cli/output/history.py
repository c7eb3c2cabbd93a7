"""What earlier runs of an output settled: the history a resuming run reads when its task opens.

A run continuing an output skips the items in committed shards (done, read from the shards' key files, never the shards), the items
that failed permanently before (anything but 503/504, until `mmenc errors retry` asks again) and
the manifest lines that were invalid before; and it refuses an id committed from another row (a
duplicate across tasks or runs). All are kept as 64-bit hashes (`idset.HashSet64`,
`keys.CommittedKeys`): under 30 bytes an item, never an object per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..idset import AttemptCounts, HashSet64, id_hash
from ..records import ManifestRow
from .outdir import OutDir
from .keyindex import load_committed
from .keys import CommittedKeys
from .report import iter_error_records, row_locator

#: failures a plain re-run tries again: remote unavailable, timed out
RETRYABLE_CODES = frozenset({503, 504})


@dataclass
class History:
    """What earlier runs of this output settled, as hashes."""

    committed: CommittedKeys = field(default_factory=CommittedKeys)  # the committed shards' keys and sources
    failed: HashSet64 = field(default_factory=HashSet64)  # (id, modality, manifest) failed permanently
    invalid: HashSet64 = field(default_factory=HashSet64)  # (manifest, offset) of invalid lines
    attempts: AttemptCounts = field(default_factory=AttemptCounts)  # (id, modality) -> attempts so far

    @property
    def done(self) -> HashSet64:
        """(id, modality) in committed shards."""
        return self.committed.done

    def duplicate_of(self, row: ManifestRow, holds: Callable[[str, int, str], bool]) -> str | None:
        """Where `row`'s id was committed from, when that is another row: another task's or an
        earlier run's (a 409). A row of a text manifest that moved (the manifest edited in place,
        so its offset changed) is no duplicate: `holds(manifest, offset, id)` reads the committed
        row's place again, and only when it still holds this id are there two rows of it."""
        found = self.committed.other_source(row.id, id_hash(row.manifest, row.locator))
        if found is None:
            return None
        manifest, offset, shard = self.committed.origin(*found)
        if manifest is None:
            return f"shard {shard}"
        if offset >= 0 and not holds(manifest, offset, row.id):
            return None
        return f"{manifest} at offset {offset} (shard {shard})" if offset >= 0 else f"{manifest} (shard {shard})"

    def retries(self, row: ManifestRow, modalities: tuple[str, ...]) -> bool:
        """Whether every item `row` asks for failed before and is not encoded: a retry of those
        items (its id may be committed from another row for its other modalities)."""
        asked = [id_hash(row.id, m) for m in modalities if row.value(m) is not None]
        return bool(asked) and all(self.attempts.get(h) > 0 and h not in self.done for h in asked)


def load_history(out: OutDir, owner: tuple[int, int] | None = None) -> History:
    """Read the committed shards' keys (`output/keyindex.py`) and the error reports of every task;
    `owner`: the (task, worker) that reads it to commit shards (`keyindex.iter_key_rows`)."""
    history = History(committed=load_committed(out, owner))
    lines: dict[int, tuple[str, str]] = {}  # invalid lines: (time, status) of the latest row each
    for row in iter_error_records(out.error_report_paths()):
        if row.get("modality") is None:
            key, seen = id_hash(row.get("manifest"), row_locator(row)), (str(row.get("time")), "")
            if seen[0] >= lines.get(key, ("", ""))[0]:
                lines[key] = (seen[0], str(row.get("status")))
            continue
        if row.get("status") != "failed":
            continue
        key = id_hash(row.get("id"), row.get("modality"))
        history.attempts.add(key, int(row.get("attempt") or 1))
        if int(row.get("code") or 500) not in RETRYABLE_CODES:
            history.failed.add(id_hash(row.get("id"), row.get("modality"), row.get("manifest")))
    history.attempts.freeze()
    history.invalid = HashSet64(np.fromiter((k for k, (_, status) in lines.items() if status == "failed"),
                                            dtype=np.uint64))
    return history
