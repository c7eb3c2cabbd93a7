"""A task's way into its output: the one door for the run code.

A run enters the output package once per act: `open_task` (prepare the folder, take the task's
lock, `--overwrite`, remove a killed run's temp files, reconcile the shard log, check the options
against `run.json` or create it, record the task as running, read the history a resume needs,
open the error report), then `TaskOutput.commit` once per shard (its key file, side files, the
shard itself, the shard log), `TaskOutput.flush_report` once per report flush, and
`TaskOutput.close` once at the end (the task's record, the report, the lock).

Three roles: "task" (a run of one task, all of the above); "devices" (the parent of one process
per device: lock, overwrite, clean-up and the task's record, no facts, history or report);
"device" (one device worker under its parent: its own lock, the facts, history and report, no
task record).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import LockBusy, OutputError
from ..stopping import Interrupted, interruptible
from .admit import Admission, admit
from .outdir import OutDir
from .fs import read_json
from .history import History, load_history
from .keyindex import PackWriter
from .keys import KeyRecord, hashed, key_rows, write_keys
from .layout import report_part_name, shard_name
from .lease import Lease
from .locks import TaskLock
from ..records import ErrorRecord
from .report import ErrorReportWriter, PartReportWriter
from .shardlog import log_commit, reconcile

log = logging.getLogger("mmenc")

ROLES = ("task", "devices", "device")


@dataclass(frozen=True)
class TaskRequest:
    """What opening a task needs from the run. `meta()` gives the task's record while it runs;
    `storage_options` go to an object store's filesystem; `single_writer`: the scheduler runs one
    runner per task, so a store without exclusive create may be used."""

    root: str
    task: int
    worker: int = 0
    role: str = "task"
    overwrite: bool = False
    wait_lock: bool = False
    stop: Any = None
    admission: Admission | None = None
    meta: Callable[[], dict[str, Any]] | None = None
    storage_options: dict[str, str] | None = None
    single_writer: bool = False


@dataclass(frozen=True, slots=True)
class Committed:
    """One shard's commit: its name and, when it failed, why (`fault`: the output failed, not the shard)."""

    name: str
    error: Exception | None = None
    fault: bool = False


class TaskOutput:
    """An open task: what it may write and what it read. `interrupted` when a stop request came
    before the task was ready (it holds no facts or history then). Its claim on the task is an
    flock in a local folder, a `Lease` (a heartbeat in its record) in an object store."""

    def __init__(self, out: OutDir, request: TaskRequest, claim: TaskLock | Lease | None) -> None:
        self.out, self.request, self._claim = out, request, claim
        self.root = str(out.root)
        self.facts: dict[str, Any] = {}
        self.history = History()
        self.interrupted = False
        self.report: ErrorReportWriter | PartReportWriter | None = None
        self._seq = 0
        self._packs = PackWriter(out)
        self._record_lock = threading.Lock()  # the heartbeat rewrites the record the run writes
        self._last: dict[str, Any] = {}
        self._found: list[Any] = []  # the record this run replaced, once it wrote its own (None: none was there)
        self._committed: dict[str, int] = {}  # shard name -> rows, of the shards this run committed
        self.run_meta: dict[str, Any] | None = None  # run.json as this run read or created it
        self.created_meta = False  # this run created run.json
        self.created_root = False  # this run created OUT (a local folder)

    def commit(self, shard: Any, writer: Any) -> Committed:
        """Commit one shard (`writers.ShardData`, encoded by a `writers.ShardWriter`): its side
        files, then the shard under its name (the commit), then its key file (with each file's
        SHA-256) and, locally, the shard log; its keys go into the runner's next key pack
        (`keyindex.py`). A fault of the
        output (`OSError`) or a name another runner of the task took first (`LockBusy`) is
        `Committed.fault`: nothing more should be written; anything else (a writer's ValueError)
        fails this shard alone."""
        req = self.request
        name = shard_name(req.task, req.worker, self._seq, writer.ext)
        self._seq += 1
        sums: dict[str, str] = {}  # each file's SHA-256, taken from its staged copy before the commit
        try:
            committed = self.out.publish_shard_files(name, hashed(writer.files(shard, name), sums))
            size = self.out.size_of(committed)
            sources = [(r.manifest, r.locator, r.offset) for r in shard.refs]
            record = KeyRecord(*key_rows(shard.ids, shard.modalities, sources), size, sums)
            write_keys(self.out, name, record)
        except (OSError, LockBusy) as exc:
            return Committed(name, exc, fault=True)
        except Exception as exc:  # the run turns the shard's items into error rows
            return Committed(name, exc)
        if not self.out.in_store:
            log_commit(self.out, req.task, req.worker, committed, len(shard), size)  # a fault ends the run
        self._packs.add(name, record)
        self._committed[committed.name] = len(shard)
        _quietly(self._refresh)  # the record says how far the task is; a fault there is no shard's
        return Committed(name)

    def flush_report(self, records: list[ErrorRecord], sync: bool) -> None:
        """Hand error rows to the task's report; with `sync`, make them durable."""
        assert self.report is not None
        for record in records:
            self.report.write(record)
        if sync:
            self.report.sync()

    def close(self, record: dict[str, Any] | None, best_effort: bool = False, lost: bool = False,
              refused: bool = False) -> None:
        """Close the report, write the task's `record` (its final state; None for a device worker,
        whose parent keeps the record) and release the task. With `best_effort`, after a fault of
        the output, a record that cannot be written is not an error of its own; `lost`: another
        runner took the task, which reports the items, so rows not written yet are dropped;
        `refused`: the run ends before its first item, so the record it replaced is put back.
        OutputError (the task recorded as failed) when shards this run committed are gone (`_lost`)."""
        lost_shards = None
        try:
            lost_shards = None if best_effort or lost or refused else self._lost()
            if lost_shards and record is not None:
                record = {**record, "state": "failed", "error": lost_shards}
            self._packs.flush()
            if isinstance(self._claim, Lease):
                self._claim.release()  # no heartbeat may overwrite the final record
            if refused:
                _quietly(self._restore)
                _quietly(self._undo_meta)
            if isinstance(self.report, PartReportWriter) and lost:
                self.report.discard()
            if self.report is not None:
                report, self.report = self.report, None
                report.close() if not best_effort else _quietly(report.close)
            if record is not None and self.request.role != "device":
                self._record(record) if not best_effort else _quietly(lambda: self._record(record))
        finally:
            if isinstance(self._claim, TaskLock):
                self._claim.release()
            self._claim = None
            self.out.close()
        if refused and self.created_root:
            _remove_if_only_locks(self.out, self.out.lock_path(self.request.task))
        if lost_shards:
            raise OutputError(lost_shards)

    def _lost(self) -> str | None:
        """What is gone of what this run committed, checked with one listing: shards (named, for a
        re-run to encode their items again) and run.json, which is written again from what this run
        read (a re-run of an output that lost it would be refused). None when everything is there."""
        if not self._committed:
            return None
        try:
            present = {path.name for path in self.out.shards()}
            if self.run_meta is not None and not self.out.run_meta_path.exists():
                self.out.create_run_meta(self.run_meta)
                log.warning("%s was gone from %s: written again", self.out.run_meta_path.name, self.root)
        except (OSError, OutputError) as exc:  # the output cannot say: the run cannot claim it holds it all
            return (f"cannot check that the shards this run committed to {self.root} are still there "
                    f"({exc}); run the same command again to finish")
        gone = [name for name in self._committed if name not in present]
        if not gone:
            return None
        rows = sum(self._committed[name] for name in gone)
        shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        return (f"{len(gone)} shard{'s' if len(gone) != 1 else ''} this run committed to {self.root} "
                f"({rows} embeddings) {'are' if len(gone) != 1 else 'is'} gone ({shown}): something removed "
                "them while the run went on; run the same command again to encode their items again")

    def _record(self, data: dict[str, Any]) -> None:
        """Write the task's record (`tasks/task-NNNNN.json`); a run's start keeps the state the
        task was left in as `previous_state`; in a store the record carries the heartbeat."""
        data = {"host": platform.node(), "pid": os.getpid(), **data}
        if data.get("state") == "running":
            previous = read_json(self.out.task_meta_path(self.request.task))
            if isinstance(previous, dict):
                data["previous_state"] = previous.get("state")
            if not self._found:
                self._found.append(previous if isinstance(previous, dict) else None)
        with self._record_lock:
            self._last = data
            if isinstance(self._claim, Lease):
                data = self._claim.stamp(data)
            self.out.write_task_meta(self.request.task, data)

    def _restore(self) -> None:
        """Put back the record this run replaced when it started (or remove its own, where there was
        none): a run that was refused or failed before its first item changes no record."""
        if not self._found:
            return
        found, self._found = self._found[0], []
        path = self.out.task_meta_path(self.request.task)
        with self._record_lock:
            self._last = {}
            if found is None:
                self.out.fs.remove(path)
            else:
                self.out.write_task_meta(self.request.task, found)

    def _undo_meta(self) -> None:
        """After a refused start: the run.json this run created (when no shard was committed since)
        and its empty error report go, so the same OUT takes a corrected command."""
        report = self.out.error_report_path(self.request.task, self.request.worker)
        if not self.out.in_store and report.exists() and report.stat().st_size == 0:
            self.out.fs.remove(report)
        if self.created_meta and not self.out.shards():
            self.out.fs.remove(self.out.run_meta_path)

    def _refresh(self) -> None:
        """Write the running task's record again with what `meta()` says now (its counts and
        progress), so `mmenc status` shows how far a running task is; a device worker has none."""
        if self.request.meta is None or self.request.role == "device" or not self._last:
            return
        with self._record_lock:
            data = self._last = {**self._last, **self.request.meta()}  # keeps the start's previous_state
            if isinstance(self._claim, Lease):
                data = self._claim.stamp(data)
            self.out.write_task_meta(self.request.task, data)

    def _beat(self) -> None:
        """Rewrite the last record with a fresh heartbeat (the lease's background thread)."""
        with self._record_lock:
            if isinstance(self._claim, Lease) and self._last:
                self.out.write_task_meta(self.request.task, self._claim.stamp(self._last))


def _remove_if_only_locks(out: OutDir, own_lock: Path) -> None:
    """Remove a local OUT that a refused start created, when nothing but empty folders and this
    task's own lock file is left in it: a runner that started beside it (its lock file, anything it
    wrote) keeps the folder."""
    root = Path(str(out.root))
    if not [p for p in root.rglob("*") if p.is_file() and p != own_lock]:
        shutil.rmtree(root, ignore_errors=True)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except (OutputError, OSError):
        pass


def open_task(req: TaskRequest) -> TaskOutput:
    """Open a task on its output (see the module docstring). LockBusy when another live run holds
    the task; LockWaitInterrupted when a stop came while waiting for it; OutputError for a fault
    of the output or options that differ from the output's."""
    if req.role not in ROLES:
        raise ValueError(f"role {req.role!r} is not one of {ROLES}")
    out = OutDir(req.root, req.storage_options)
    created = not out.in_store and not Path(str(out.root)).exists()
    try:
        out.prepare()  # exists and writable (OutputError) before taking the lock
        task = TaskOutput(out, req, _claim(out, req))
        task.created_root = created
    except BaseException:
        out.close()
        raise
    try:
        if isinstance(task._claim, Lease) and req.meta is not None:  # in a store: say so before the model loads
            task._record(req.meta())
            _heartbeat(task)
        if req.role != "device":
            _settle(out, req)
            if req.overwrite and task._found:
                task._found = [None]  # the record it replaced went with the wipe: a refusal removes its own
        if req.role == "devices":
            if not isinstance(task._claim, Lease):
                assert req.meta is not None
                task._record(req.meta())
            return task
        if req.stop is not None and req.stop.is_set():  # stopped before starting: no model loaded for nothing
            task.interrupted = True
            return task
        _ready(task)
    except BaseException:
        task.close(None, best_effort=True, refused=True)
        raise
    return task


def _claim(out: OutDir, req: TaskRequest) -> TaskLock | Lease | None:
    """The task's flock (a device worker's own, under its parent's), or in a store its lease,
    after the store's probe (a device worker's parent holds the lease)."""
    if not out.in_store:
        worker = req.worker if req.role == "device" else None
        return out.lock(req.task, wait=req.wait_lock or req.role == "device", stop=req.stop, worker=worker,
                        poll=0.5 if req.role == "device" else 1.0)
    if req.role == "device":
        return None
    if not out.probe() and not req.single_writer:
        raise OutputError(f"{out.root}: this store wrote an object whose name existed (no exclusive create), so "
                          "two runners of a task could both commit it; use a store that refuses (S3, GCS, Azure "
                          "do), or pass --single-writer if the scheduler never runs a task twice at once")
    lease = Lease(out.task_meta_path(req.task), req.task)
    lease.claim(wait=req.wait_lock, stop=req.stop)
    return lease


def _heartbeat(task: TaskOutput) -> None:
    if isinstance(task._claim, Lease):
        task._claim.renew_with(task._beat)


def _settle(out: OutDir, req: TaskRequest) -> None:
    """Holding the task: --overwrite, a killed run's temp files (and, in a store, its unfinished
    uploads), the shard log."""
    if req.overwrite:
        busy = out.busy_tasks(req.task)
        if busy:
            raise OutputError(f"--overwrite: other runs are writing {out.root} (tasks {', '.join(map(str, busy))})")
        out.wipe()
        out.prepare()
    out.clean_tmp(req.task)
    if not out.in_store:
        reconcile(out, req.task)


def _ready(task: TaskOutput) -> None:
    """The facts (from run.json, or a new run.json: the model loads), the task's record, the
    history and the report. A stop request meanwhile leaves the task `interrupted`."""
    req, out = task.request, task.out
    assert req.admission is not None
    try:
        with interruptible(req.stop):
            task.run_meta, task.created_meta = admit(out, req.admission)
            task.facts = dict(task.run_meta.get("facts") or {})
            if req.role == "task" and not isinstance(task._claim, Lease):
                assert req.meta is not None
                task._record(req.meta())
            # the sequence before the history: its shards are all in the history, so a second runner
            # that started unseen reuses a name the first one commits (and stops there), never skips ahead
            task._seq = out.next_seq(req.task, req.worker)
            task.history = load_history(out, (req.task, req.worker))
    except Interrupted:
        task.interrupted = True
        return
    task.report = _report(task)


def _report(task: TaskOutput) -> ErrorReportWriter | PartReportWriter:
    req, out = task.request, task.out
    if not out.in_store:
        return ErrorReportWriter(out.error_report_path(req.task, req.worker))
    runner = task._claim.runner if isinstance(task._claim, Lease) else os.urandom(6).hex()
    return PartReportWriter(out.fs, out.meta / "errors",
                            lambda k: report_part_name(req.task, req.worker, task._seq, runner, k))
