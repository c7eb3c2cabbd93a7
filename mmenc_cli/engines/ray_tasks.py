"""What runs in Ray's workers for `mmenc ray`: `mmenc_task` (one task's slice, encoded in the worker
process itself: its workers show `ray::mmenc_task`), `mmenc_check` (before the job: this mmenc,
the model, the inputs and OUT's filesystem resolve on a worker), `mmenc_status` (after it: what
`mmenc status` says, read where the tasks ran) and `ProgressBoard`, the actor the tasks report
their counts to. Ray finds these by reference: mmenc must be installed on every node, the same
version (`mmenc_check` says so when it is not).

In a task: every process it starts dies with it (`lifeline.require`), so a SIGKILLed worker leaves
no decode worker, forkserver or device worker behind, and Ray's retry of the task resumes from the
output exactly once. SIGINT (what Ray's cancel sends the worker's main thread) and SIGTERM become
a stop request: whole shards are committed and the task is recorded interrupted; the handlers are
restored afterwards, since Ray reuses the worker. A slice held by another live runner (exit 75) is
waited for (`--wait-lock`) and then resumed, also when a race at a shard's exclusive create is
lost. No credential travels with a task: the worker's store filesystem reads its own node's chain.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import ray

from .. import __version__, lifeline
from ..config import RunConfig
from ..errors import LockBusy, ManifestError, RunError
from ..run.counters import Counters, RunResult
from ..stopping import request_stop
from .job import RETRIED, TaskOutcome, job_size, task_code

log = logging.getLogger("mmenc")

#: times a task re-opens its slice after losing a race at a shard's exclusive create (exit 75)
LOCK_TRIES = 5
#: seconds between two progress reports of one task
REPORT_EVERY = 1.0


@ray.remote(num_cpus=0)
class ProgressBoard:
    """Where the tasks report: per task, attempts, host and pid of the latest, its latest counts,
    and its final result once it returns (also when it was cancelled)."""

    def __init__(self) -> None:
        self.tasks: dict[int, dict[str, Any]] = {}

    def started(self, task: int, host: str, pid: int) -> None:
        entry = self.tasks.setdefault(task, {"attempts": 0})
        entry.update(attempts=entry["attempts"] + 1, host=host, pid=pid, counters=None, result=None)

    def report(self, task: int, counters: Counters) -> None:
        self.tasks.setdefault(task, {"attempts": 1})["counters"] = counters

    def finished(self, task: int, result: RunResult) -> None:
        self.tasks.setdefault(task, {"attempts": 1}).update(counters=result.counters, result=result)

    def snapshot(self) -> dict[int, dict[str, Any]]:
        return self.tasks


class TaskRetry(Exception):
    """A task's code that Ray retries (`job.RETRIED`); after the last retry, the task's code."""

    def __init__(self, task: int, code: int, message: str) -> None:
        super().__init__(f"task {task} exited {code}: {message}")
        self.task, self.code, self.message = task, code, message

    def __reduce__(self) -> tuple[Any, ...]:
        return (TaskRetry, (self.task, self.code, self.message))


class StopSignals:
    """SIGINT and SIGTERM as a stop request while a task runs in the worker's main thread (a
    second SIGINT stops at once); the worker's own handlers come back at the end."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("task received %s: committing whole shards, then stopping", signal.Signals(signum).name)
        request_stop(self.stop)

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Reporter:
    """The encode run's progress callback: the task's counts to the board, once a second."""

    def __init__(self, board: Any, task: int) -> None:
        self.board, self.task, self.last = board, task, 0.0

    def __call__(self, counters: Counters) -> None:
        now = time.monotonic()
        if now - self.last >= REPORT_EVERY:
            self.last = now
            self.board.report.remote(self.task, counters)  # the counts are pickled here, on the loop's thread

    def final(self, result: RunResult) -> None:
        """The task's result on the board before the task returns (a cancelled task's return is lost)."""
        try:
            ray.get(self.board.finished.remote(self.task, result), timeout=60)
        except Exception as exc:  # the board gone with the driver: nobody to tell
            log.debug("task %d: could not report its result: %s", self.task, exc)


def _logging() -> None:
    """mmenc's log lines on the worker's stderr, which Ray shows on the driver."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s mmenc %(levelname)s: %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _encode(cfg: RunConfig, report: Reporter, stop: threading.Event) -> tuple[RunResult | None, int, str | None, bool]:
    """Run the task: (result, code, why it failed, whether Ray should retry it)."""
    from ..run.pipeline import run_encode  # torch and transformers load here, in the worker

    for _ in range(LOCK_TRIES):
        try:
            result = run_encode(cfg, progress=report, stop=stop)
        except LockBusy as exc:  # a race at a shard's exclusive create lost: wait for the winner, resume
            if stop.is_set():
                return None, exc.exit_code, str(exc), True
            log.warning("task %d: %s; waiting for it, then resuming", cfg.task_index, exc)
            continue
        except RunError as exc:
            return None, exc.exit_code, str(exc), exc.exit_code in RETRIED
        code = task_code(result)
        error = "its counts do not balance" if code == 1 else None
        return result, code, error, result.state == "interrupted"
    return None, int(LockBusy.exit_code), "another runner kept winning its shards", True


@ray.remote
def mmenc_task(cfg: RunConfig, board: Any) -> TaskOutcome:
    """Encode task `cfg.task_index`'s slice in this worker process (see the module docstring)."""
    lifeline.require()
    _logging()
    task, host = cfg.task_index, socket.gethostname()
    board.started.remote(task, host, os.getpid())
    stop = threading.Event()
    report = Reporter(board, task)
    with StopSignals(stop):
        result, code, error, retry = _encode(cfg, report, stop)
    if result is not None:
        report.final(result)
    if retry:
        raise TaskRetry(task, code, error or "interrupted")
    state = result.state if result is not None and code in (0, 4) else "failed"
    return TaskOutcome(task=task, code=code, state=state, result=result, error=error, host=host)


@ray.remote
def mmenc_check(version: str, cfg: RunConfig, tasks: int = 1) -> tuple[int, str] | Any:
    """On a worker, before the job: the same mmenc as the driver's, and the model, the inputs and
    OUT's filesystem resolve here; (exit code, why) when not, else the job's size (every task's
    slice, `readers.work_size`, summed: a `Reading` with nothing done; None when not known)."""
    host = socket.gethostname()
    if version != __version__:
        return 3, (f"the Ray worker on {host} has mmenc {__version__}, this driver {version}: install the same "
                   "version on every node")
    try:
        sources = _resolve(cfg)
    except RunError as exc:
        return exc.exit_code, f"on the Ray worker on {host}: {exc}"
    try:
        return job_size(sources, cfg, tasks)
    except Exception as exc:  # the job still runs: its progress shows no percentage
        log.debug("the job's size is not known: %s", exc)
        return None


def _resolve(cfg: RunConfig) -> list[Any]:
    """The inputs, the model and OUT's filesystem, as a task would meet them (RunError when not);
    the inputs' planned sources."""
    from ..encoders.libraries import import_library, split_model
    from ..encoders.loading import probe_model
    from ..output import OutDir
    from ..readers.files import check_input
    from ..readers import preflight

    for given in cfg.manifests:
        check_input(given)
    sources = preflight(cfg.manifests, cfg.manifest)  # the inputs and the keys their rows hold
    if not sources:
        raise ManifestError(f"the inputs name no file here: {' '.join(cfg.manifests)}")
    library, _ = split_model(cfg.model.model)
    if library is not None:
        import_library(library)
    else:
        probe_model(cfg.model)
    OutDir(cfg.writer.out, cfg.writer.store_options).close()
    return sources


@ray.remote
def mmenc_status(out: str, storage_options: dict[str, str] | None = None) -> Any:
    """What `mmenc status OUT` says, read on a worker (where the tasks' output is reachable)."""
    from ..output import open_output
    from ..output.status import collect_status

    return collect_status(open_output(out, storage_options))
