"""`mmenc status OUT`: per task done or not, items encoded, errors, duplicates, what to re-run.

Read-only and torch-free. Sources: the task metadata (`_mmenc/tasks/*.json`, one per task, or per
task and worker), the committed shards' key files (the task number is in the shard name), the
error reports (latest outcome per item) and the task locks.

A task needs a re-run when it has no metadata (never started, or its first run died before
writing any), ended 'interrupted' or 'stopped', ended over the error threshold, ran with another
task count, or says 'running' while no process holds its lock (crashed: the kernel drops an flock
with its process). Lock probing uses a shared, non-blocking flock that is released at once and
writes nothing; it is done only for tasks that say 'running', so it cannot make a starting run
exit 75 except in the microseconds a crashed task's replacement takes its lock.

Problems: a shard a task's log lists as committed that is gone, a shard that cannot be read, a
damaged `run.json` or task file, an error-report line that is not a row. Each is named with what
to do, and makes the status not ok (exit 4): it never says "all done" over them.

Duplicates: (id, modality) pairs present in shards of more than one task, or twice in one, and ids
committed from more than one row. Everything is read from the shards' key files (`output/keys.py`),
never the shards; shards are read, for a few example ids, only when there are duplicates.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OutputError
from ..idset import hash_many
from .damage import missing_shard_problems, run_meta_problem, task_meta_problems
from .fs import read_json
from .keyindex import iter_key_rows
from .keys import UNKNOWN
from .layout import parse_shard_name
from .outdir import OutDir, open_output
from .shard_ids import iter_shard_keys

DONE = "done"
MISSING = "missing"


@dataclass
class TaskStatus:
    """One task's line in the status."""

    task: int
    state: str = MISSING  # done, running, interrupted, stopped (as recorded), or missing
    encoded: int = 0
    errors: int = 0
    running: bool = False
    needs_rerun: bool = False
    reason: str | None = None
    host: str | None = None
    updated: str | None = None
    percent: float | None = None  # how far it is, from its record's progress (None: not known)


@dataclass
class Duplicates:
    """(id, modality) pairs found in shards of several tasks (`within_task`: repeated inside one
    task); `ids`: ids committed from more than one row (two rows of one id, encoded by tasks that
    ran at the same time and could not see each other's shards)."""

    count: int = 0
    within_task: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    ids: int = 0

    def __bool__(self) -> bool:
        return bool(self.count or self.within_task or self.ids)


@dataclass
class StatusReport:
    """The whole `mmenc status` answer."""

    out: str
    task_count: int
    tasks: list[TaskStatus]
    duplicates: Duplicates
    all_done: bool
    rerun: list[int]
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """All tasks done, no problems and no duplicates: exit code 0."""
        return self.all_done and not self.problems and not self.duplicates

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _metas(od: OutDir, problems: list[str]) -> dict[int, list[tuple[int, float, dict[str, Any]]]]:
    """Task metadata grouped by task: (lock id, mtime, meta) per file (one per worker)."""
    grouped: dict[int, list[tuple[int, float, dict[str, Any]]]] = defaultdict(list)
    for lock_id, path in od.task_meta_paths():
        meta = read_json(path)
        if isinstance(meta, dict):
            grouped[int(meta.get("task", lock_id))].append((lock_id, path.stat().st_mtime, meta))
    problems += task_meta_problems(od)
    return grouped


def _task_count(od: OutDir, metas: dict[int, list[tuple[int, float, dict[str, Any]]]]) -> int:
    """The task count of the newest task metadata, else of the run metadata."""
    entries = [e for group in metas.values() for e in group if e[2].get("task_count")]
    if entries:
        return int(max(entries, key=lambda e: e[1])[2]["task_count"])
    run = od.read_run_meta()
    if not isinstance(run, dict):
        raise OutputError(f"{od.root} is not an mmenc output (no {od.run_meta_path.relative_to(od.root)} "
                          "and no task metadata)")
    return int((run.get("config") or {}).get("task_count") or 1)


def _scan_shards(od: OutDir, problems: list[str], sums: dict[str, dict[str, str]] | None = None
                 ) -> tuple[Counter[int], dict[int, np.ndarray], int, int]:
    """From the shards' key files: embeddings per task, each task's sorted unique (id, modality)
    hashes, rows repeated within a task, and ids committed from more than one row (`sums`: see
    `keyindex.iter_key_rows`)."""
    encoded: Counter[int] = Counter()
    parts: dict[int, list[np.ndarray]] = defaultdict(list)
    sources: list[np.ndarray] = []
    for shard, _path, rows in iter_key_rows(od, damaged=problems, sums=sums):
        parsed = parse_shard_name(shard.name)
        task = parsed.task if parsed else -1
        encoded[task] += rows.size
        parts[task].append(rows["item"])
        sources.append(rows[["id", "src"]])
    keys, within = {}, 0
    for task, arrays in parts.items():
        raw = np.concatenate(arrays) if arrays else np.zeros(0, np.uint64)
        keys[task] = np.unique(raw)
        within += int(raw.size - keys[task].size)
    every = np.concatenate(sources) if sources else np.zeros(0, [("id", "<u8"), ("src", "<u8")])
    pairs = np.unique(every[every["src"] != UNKNOWN])
    ids = int(np.unique(pairs["id"][1:][pairs["id"][1:] == pairs["id"][:-1]]).size) if pairs.size > 1 else 0
    return encoded, keys, within, ids


def find_duplicates(od: OutDir, problems: list[str], examples: int = 5,
                    sums: dict[str, dict[str, str]] | None = None) -> Duplicates:
    """Every kind of duplicate in an output, with a few example ids (for `status` and `inspect`);
    `sums` gets each shard's file checksums recorded at commit (`keyindex.iter_key_rows`)."""
    _, keys, within, ids = _scan_shards(od, problems, sums)
    return _duplicates(od, keys, within, ids, examples)


def _duplicates(od: OutDir, keys: dict[int, np.ndarray], within: int, ids: int, examples: int) -> Duplicates:
    """Count keys present in several tasks; look up a few example ids."""
    every = np.sort(np.concatenate(list(keys.values()))) if keys else np.zeros(0, np.uint64)
    dup = np.unique(every[1:][every[1:] == every[:-1]]) if every.size > 1 else every[:0]
    result = Duplicates(count=int(dup.size), within_task=within, ids=ids)
    if dup.size and examples:
        wanted = dup[:examples]
        found: dict[int, dict[str, Any]] = {}
        for shard, ids_, mods in iter_shard_keys(od, damaged=[]):  # damaged ones are named already
            hashes = hash_many(ids_, mods)
            parsed = parse_shard_name(shard.name)
            for i in np.flatnonzero(np.isin(hashes, wanted)):
                entry = found.setdefault(int(hashes[i]), {"id": ids_[i], "modality": mods[i], "tasks": []})
                if parsed and parsed.task not in entry["tasks"]:
                    entry["tasks"].append(parsed.task)
        result.examples = [found[int(h)] for h in wanted if int(h) in found]
    return result


def _errors_by_task(od: OutDir, problems: list[str]) -> Counter[int]:
    """Current failures (latest outcome per item) per task."""
    if not od.error_report_paths():
        return Counter()
    from ..error_rows import latest_errors

    damaged: list[str] = []
    rows = latest_errors(od, damaged=damaged)
    problems += [f"{d}: the report is damaged there (the line is skipped)" for d in damaged]
    return Counter(int(r.get("task") or 0) for r in rows)


def _judge(ts: TaskStatus, group: list[tuple[int, float, dict[str, Any]]], od: OutDir, task_count: int) -> None:
    """Fill state, running, needs_rerun and reason of one task from its metadata (one per worker)."""
    if ts.task >= task_count:
        ts.reason = f"not part of the current split into {task_count} tasks"
    if not group:
        ts.needs_rerun = ts.task < task_count
        ts.reason = ts.reason or "never ran (no task metadata)"
        return
    newest = max(group, key=lambda e: e[1])[2]
    ts.host, ts.updated = newest.get("host"), newest.get("updated")
    ts.percent = percent(newest.get("progress"))
    states = [m.get("state") or MISSING for _, _, m in group]
    ts.state = DONE if all(s == DONE for s in states) else next(s for s in states if s != DONE)
    held = [lid for lid, _, m in group if m.get("state") == "running" and od.task_running(lid, m)]
    ts.running = bool(held)
    if ts.task >= task_count:
        return
    crashed = [m for lid, _, m in group if m.get("state") == "running" and lid not in held]
    counts = {int(m.get("task_count") or 0) for _, _, m in group}
    over = next((m.get("threshold_exceeded") for _, _, m in group if m.get("threshold_exceeded")), None)
    if ts.running:
        ts.reason = f"running on {ts.host} (pid {newest.get('pid')})"
    elif crashed:
        ts.needs_rerun, ts.reason = True, (f"crashed: state 'running' but no process holds its lock "
                                           f"(last on {crashed[0].get('host')}, pid {crashed[0].get('pid')})")
    elif ts.state != DONE:
        error = next((m.get("error") for _, _, m in group if m.get("error")), None)
        ts.needs_rerun, ts.reason = True, f"{ts.state}: {error}" if error else ts.state
    elif counts != {task_count}:
        ts.needs_rerun, ts.reason = True, f"ran with task count {sorted(counts)}, not {task_count}"
    elif over:
        ts.needs_rerun, ts.reason = True, f"error threshold exceeded: {over}"


def percent(progress: Any) -> float | None:
    """The percentage of a task record's `progress` ({done, total, unit}); None when it has none."""
    if not isinstance(progress, dict) or not isinstance(progress.get("total"), int) \
            or not isinstance(progress.get("done"), int):
        return None
    total = progress["total"]
    return 100.0 if total <= 0 else round(100.0 * min(max(progress["done"], 0), total) / total, 1)


def collect_status(out: "str | Path | OutDir", examples: int = 5) -> StatusReport:
    """The status of every task of an output (raises OutputError when OUT is not an mmenc output)."""
    od = open_output(out)
    if not od.root.is_dir():
        raise OutputError(f"{od.root}: no such output folder")
    problems = [p for p in [run_meta_problem(od)] if p]
    metas = _metas(od, problems)
    task_count = _task_count(od, metas)
    encoded, keys, within, ids = _scan_shards(od, problems)
    errors = _errors_by_task(od, problems)
    gone = _missing_by_task(od, problems)
    tasks = []
    for t in sorted(set(range(task_count)) | set(metas) | {k for k in encoded if k >= 0}):
        ts = TaskStatus(task=t, encoded=encoded.get(t, 0), errors=errors.get(t, 0))
        _judge(ts, metas.get(t, []), od, task_count)
        if gone.get(t) and not ts.running:
            ts.needs_rerun, ts.reason = True, f"{gone[t]} committed shard(s) missing: re-run to encode their items"
        tasks.append(ts)
    current = [ts for ts in tasks if ts.task < task_count]
    all_done = not problems and all(ts.state == DONE and not ts.needs_rerun and not ts.running for ts in current)
    return StatusReport(out=str(od.root), task_count=task_count, tasks=tasks,
                        duplicates=_duplicates(od, keys, within, ids, examples), all_done=all_done,
                        rerun=[ts.task for ts in tasks if ts.needs_rerun], problems=problems)


def _missing_by_task(od: OutDir, problems: list[str]) -> Counter[int]:
    """Shards the logs list as committed that are gone, per task (each named in `problems`)."""
    gone: Counter[int] = Counter()
    for task, problem in missing_shard_problems(od):
        gone[task] += 1
        problems.append(problem)
    return gone
