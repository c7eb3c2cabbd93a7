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
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..errors import OutputError
from ..stopping import Interrupted, interruptible
from .outdir import OutDir
from .fs import read_json
from .history import History, load_history
from .keys import key_rows, write_keys
from .layout import shard_name
from .locks import TaskLock
from ..records import ErrorRecord
from .report import ErrorReportWriter
from .shardlog import log_commit, reconcile

log = logging.getLogger("mmenc")

ROLES = ("task", "devices", "device")


class Admission(Protocol):
    """The run's side of opening a task: its fingerprint and how it judges an output's."""

    def fingerprint(self, recorded: dict[str, Any] | None) -> dict[str, Any]:
        """The run's fingerprint, given the output's run.json (None: a new output)."""

    def judge(self, recorded: dict[str, Any], fingerprint: dict[str, Any]) -> list[str]:
        """What differs between the output's run.json and this run's fingerprint (empty: it may
        resume), logging what only deserves a warning."""

    def create(self, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """The run.json of a new output (its facts need the model: this loads it)."""


@dataclass(frozen=True)
class TaskRequest:
    """What opening a task needs from the run. `meta()` gives the task's record while it runs."""

    root: str
    task: int
    worker: int = 0
    role: str = "task"
    overwrite: bool = False
    wait_lock: bool = False
    stop: Any = None
    admission: Admission | None = None
    meta: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Committed:
    """One shard's commit: its name and, when it failed, why (`fault`: the output failed, not the shard)."""

    name: str
    error: Exception | None = None
    fault: bool = False


class TaskOutput:
    """An open task: what it may write and what it read. `interrupted` when a stop request came
    before the task was ready (it holds no facts or history then)."""

    def __init__(self, out: OutDir, request: TaskRequest, lock: TaskLock | None) -> None:
        self.out, self.request, self._lock = out, request, lock
        self.root = str(out.root)
        self.facts: dict[str, Any] = {}
        self.history = History()
        self.interrupted = False
        self.report: ErrorReportWriter | None = None
        self._seq = 0

    def commit(self, shard: Any, writer: Any) -> Committed:
        """Commit one shard (`writers.ShardData`, encoded by a `writers.ShardWriter`): its key file
        and side files first, then the shard under its name (the commit), then the shard log. An
        OSError is a fault of the output (`Committed.fault`: nothing more should be written);
        anything else (a name taken, a writer's ValueError) fails this shard alone."""
        req = self.request
        name = shard_name(req.task, req.worker, self._seq, writer.ext)
        self._seq += 1
        try:
            self.out.check_new(name)  # before its key file: a refused shard must not replace another's
            files = writer.files(shard, name)
            sources = [(r.manifest, r.locator, r.offset) for r in shard.refs]
            write_keys(self.out, name, *key_rows(shard.ids, shard.modalities, sources))
            committed = self.out.publish_shard_files(name, files)
        except OSError as exc:
            return Committed(name, exc, fault=True)
        except Exception as exc:  # the run turns the shard's items into error rows
            return Committed(name, exc)
        log_commit(self.out, req.task, req.worker, committed, len(shard))  # a fault here ends the run
        return Committed(name)

    def flush_report(self, records: list[ErrorRecord], sync: bool) -> None:
        """Append error rows to the task's report; with `sync`, make the report durable."""
        assert self.report is not None
        for record in records:
            self.report.write(record)
        if sync:
            self.report.sync()

    def close(self, record: dict[str, Any] | None, best_effort: bool = False) -> None:
        """Close the report, write the task's `record` (its final state; None for a device worker,
        whose parent keeps the record) and release the lock. With `best_effort`, after a fault of
        the output, a record that cannot be written is not an error of its own."""
        try:
            if self.report is not None:
                report, self.report = self.report, None
                report.close() if not best_effort else _quietly(report.close)
            if record is not None and self.request.role != "device":
                self._record(record) if not best_effort else _quietly(lambda: self._record(record))
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _record(self, data: dict[str, Any]) -> None:
        """Write the task's record (`tasks/task-NNNNN.json`); a run's start keeps the state the
        task was left in as `previous_state`."""
        data = {"host": platform.node(), "pid": os.getpid(), **data}
        if data.get("state") == "running":
            previous = read_json(self.out.task_meta_path(self.request.task))
            if isinstance(previous, dict):
                data["previous_state"] = previous.get("state")
        self.out.write_task_meta(self.request.task, data)


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except OutputError:
        pass


def open_task(req: TaskRequest) -> TaskOutput:
    """Open a task on its output (see the module docstring). LockBusy when another live run holds
    the task; LockWaitInterrupted when a stop came while waiting for it; OutputError for a fault
    of the output or options that differ from the output's."""
    if req.role not in ROLES:
        raise ValueError(f"role {req.role!r} is not one of {ROLES}")
    out = OutDir(req.root)
    out.prepare()  # exists and writable (OutputError) before taking the lock
    worker = req.worker if req.role == "device" else None
    lock = out.lock(req.task, wait=req.wait_lock or req.role == "device", stop=req.stop, worker=worker,
                    poll=0.5 if req.role == "device" else 1.0)
    task = TaskOutput(out, req, lock)
    try:
        if req.role != "device":
            _settle(out, req)
        if req.role == "devices":
            assert req.meta is not None
            task._record(req.meta())
            return task
        if req.stop is not None and req.stop.is_set():  # stopped before starting: no model loaded for nothing
            task.interrupted = True
            return task
        _ready(task)
    except BaseException:
        lock.release()
        raise
    return task


def _settle(out: OutDir, req: TaskRequest) -> None:
    """Under the task's lock: --overwrite, a killed run's temp files, the shard log."""
    if req.overwrite:
        busy = [p.name for t, p in out.lock_paths() if t != req.task and TaskLock(p).is_held()]
        if busy:
            raise OutputError(f"--overwrite: other runs are writing {out.root} ({', '.join(busy)})")
        out.wipe()
        out.prepare()
    out.clean_tmp(req.task)
    reconcile(out, req.task)


def _ready(task: TaskOutput) -> None:
    """The facts (from run.json, or a new run.json: the model loads), the task's record, the
    history and the report. A stop request meanwhile leaves the task `interrupted`."""
    req, out = task.request, task.out
    assert req.admission is not None
    try:
        with interruptible(req.stop):
            task.facts = _admit(out, req.admission)
            if req.role == "task":
                assert req.meta is not None
                task._record(req.meta())
            task.history = load_history(out)
    except Interrupted:
        task.interrupted = True
        return
    task.report = ErrorReportWriter(out.error_report_path(req.task, req.worker))
    task._seq = out.next_seq(req.task, req.worker)


def _admit(out: OutDir, admission: Admission) -> dict[str, Any]:
    """The output's facts when this run's options match its run.json; a new output's, recorded
    in a new run.json. OutputError when the options differ, or run.json is damaged, or OUT holds
    shards but no run.json."""
    recorded = out.read_run_meta()
    if recorded is not None and not isinstance(recorded, dict) or recorded is None and out.run_meta_path.exists():
        raise OutputError(f"{out.run_meta_path} is damaged (not the run's options and facts): restore it, or "
                          "start over with --overwrite")
    fingerprint = admission.fingerprint(recorded)
    if recorded is None:
        if out.shards():
            raise OutputError(f"{out.root} holds shards but no {out.run_meta_path.name}: "
                              "not an mmenc output, or damaged; use --overwrite to start over")
        meta = admission.create(fingerprint)
        if out.create_run_meta(meta):
            return dict(meta["facts"])
        recorded = out.read_run_meta() or {}  # another task or device worker was first: ours must match
    diff = admission.judge(recorded, fingerprint)
    if diff:
        raise OutputError(f"{out.root} was written with other options ({'; '.join(diff)}); "
                          "use the same options, another --out, or --overwrite to start over")
    return dict(recorded.get("facts") or {})
