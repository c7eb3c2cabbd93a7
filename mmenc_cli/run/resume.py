"""Resume: whether this run may continue the output, and what earlier runs already settled.

A run continues an output only with the same fingerprint (`check_output`); it then skips the
items in committed shards (done), the items that failed permanently before (anything but 503/504,
until `mmenc errors retry` asks again) and the manifest lines that were invalid before. All three
are kept as 64-bit hashes (`idset.HashSet64`), about 8 bytes an item, never an object per row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import RunConfig
from ..errors import OutputError
from ..idset import AttemptCounts, HashSet64, id_hash
from ..locks import TaskLock
from ..outdir import OutDir, iter_shard_keys
from ..report import iter_error_records, row_locator
from .metadata import fingerprint_diff, version_changes

log = logging.getLogger("mmenc")

#: failures a plain re-run tries again: remote unavailable, timed out
RETRYABLE_CODES = frozenset({503, 504})


@dataclass
class History:
    """What earlier runs of this output settled, as hashes."""

    done: HashSet64 = field(default_factory=HashSet64)  # (id, modality) in committed shards
    failed: HashSet64 = field(default_factory=HashSet64)  # (id, modality, manifest) failed permanently
    invalid: HashSet64 = field(default_factory=HashSet64)  # (manifest, offset) of invalid lines
    attempts: AttemptCounts = field(default_factory=AttemptCounts)  # (id, modality) -> attempts so far


def load_history(out: OutDir) -> History:
    """Read the committed shards' keys and the error reports of every task."""
    parts = [np.fromiter((id_hash(i, m) for i, m in zip(ids, mods)), dtype=np.uint64, count=len(ids))
             for _shard, ids, mods in iter_shard_keys(out)]
    history = History(done=HashSet64(np.concatenate(parts) if parts else np.zeros(0, np.uint64)))  # one sort
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
