"""Resume: whether this run may continue the output, and what earlier runs already settled.

A run continues an output only with the same fingerprint (`check_output`); it then skips the
items in committed shards (done, read from the shards' key files, never the shards), the items
that failed permanently before (anything but 503/504, until `mmenc errors retry` asks again) and
the manifest lines that were invalid before; and it refuses an id committed from another row (a
duplicate across tasks or runs). All are kept as 64-bit hashes (`idset.HashSet64`,
`keyindex.CommittedKeys`): under 30 bytes an item, never an object per row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import ManifestConfig, RunConfig
from ..errors import OutputError
from ..idset import AttemptCounts, HashSet64, id_hash
from ..locks import TaskLock
from ..keyindex import CommittedKeys, load_committed
from ..outdir import OutDir
from ..records import ManifestRow
from ..report import iter_error_records, row_locator
from .metadata import fingerprint_diff, version_changes

log = logging.getLogger("mmenc")

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

    def duplicate_of(self, row: ManifestRow, cfg: ManifestConfig) -> str | None:
        """Where `row`'s id was committed from, when that is another row: another task's or an
        earlier run's (a 409). A row of a text manifest that moved (the manifest edited in place,
        so its offset changed) is no duplicate: the committed row's offset is read again, and only
        when it still holds this id are there two rows of it."""
        found = self.committed.other_source(row.id, id_hash(row.manifest, row.locator))
        if found is None:
            return None
        manifest, offset, shard = self.committed.origin(*found)
        if manifest is None:
            return f"shard {shard}"
        if offset >= 0 and not _holds(manifest, offset, row.id, cfg):
            return None
        return f"{manifest} at offset {offset} (shard {shard})" if offset >= 0 else f"{manifest} (shard {shard})"

    def retries(self, row: ManifestRow, modalities: tuple[str, ...]) -> bool:
        """Whether every item `row` asks for failed before and is not encoded: a retry of those
        items (its id may be committed from another row for its other modalities)."""
        asked = [id_hash(row.id, m) for m in modalities if row.value(m) is not None]
        return bool(asked) and all(self.attempts.get(h) > 0 and h not in self.done for h in asked)


def load_history(out: OutDir) -> History:
    """Read the committed shards' key files (`keyindex.py`) and the error reports of every task."""
    history = History(committed=load_committed(out, fill=True))
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


def _holds(manifest: str, offset: int, row_id: str, cfg: ManifestConfig) -> bool:
    """Whether the record at `offset` of `manifest` still has id `row_id` (False when the input is
    gone or changed there)."""
    from ..errors import ManifestError
    from ..readers import read_row

    try:
        return read_row(manifest, offset, cfg).id == row_id
    except (ManifestError, OSError, ValueError):
        return False


def check_output(out: OutDir, fp: dict[str, Any]) -> dict[str, Any] | None:
    """Compare with the output's recorded fingerprint; return its facts when they match, None for
    a new output. OutputError when the options differ or OUT holds shards without metadata."""
    meta = out.read_run_meta()
    if meta is not None and not isinstance(meta, dict) or meta is None and out.run_meta_path.exists():
        raise OutputError(f"{out.run_meta_path} is damaged (not the run's options and facts): restore it, or "
                          "start over with --overwrite")
    if meta is None:
        if out.shards():
            raise OutputError(f"{out.root} holds shards but no {out.run_meta_path.name}: "
                              "not an mmenc output, or damaged; use --overwrite to start over")
        return None
    diff = fingerprint_diff(meta.get("fingerprint", {}), fp)
    if diff:
        raise OutputError(f"{out.root} was written with other options ({'; '.join(diff)}); "
                          "use the same options, another --out, or --overwrite to start over")
    for name, was, now in version_changes(meta.get("versions")):  # a routine upgrade: go on, say so
        log.warning("%s was started with %s %s, this run has %s %s: resuming; vectors made by the two "
                    "versions may differ slightly", out.root, name, was, name, now)
    return meta.get("facts")


def check_commit(out: OutDir, model: str, facts: dict[str, Any], info: dict[str, Any]) -> None:
    """A hub id's fingerprint names the requested revision ("main" moves): the commit the model
    actually came from must be the one the output was started with, or vectors would mix."""
    was, now = facts.get("commit"), info.get("commit")
    if was and now and was != now:
        raise OutputError(f"{model} now resolves to commit {now}, but {out.root} was written with commit "
                          f"{was}: pin --revision {was}, use another --out, or --overwrite to start over")


def open_output(out: OutDir, cfg: RunConfig, task: int) -> None:
    """Under this task's lock: refuse --overwrite while other tasks run, wipe OUT (not its locks), prepare."""
    if cfg.overwrite:
        busy = [p.name for p in sorted((out.meta / "locks").glob("task-*.lock"))
                if p != out.lock_path(task) and TaskLock(p).is_held()]
        if busy:
            raise OutputError(f"--overwrite: other runs are writing {out.root} ({', '.join(busy)})")
        out.wipe()
        out.prepare()
