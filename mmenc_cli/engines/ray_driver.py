"""The `mmenc ray` driver: connect to a Ray cluster (or start a local one), check on one worker that
the job can run there, submit the N tasks, show one progress display across them, cancel them when
the driver is stopped, and gather their outcomes into one `JobResult` (`job.py` says how).

Ray retries a task whose worker or node died, and one that hands back a code of `job.RETRIED`
(`ray_tasks.TaskRetry`), up to `--max-retries` times; a retry resumes from the output. A stop
request (the first Ctrl-C or SIGTERM) cancels every task: Ray interrupts the running ones, which
commit whole shards and record themselves interrupted; a second Ctrl-C kills their workers. With
`--fail-fast`, the first task that stops at a failed item has the others cancelled the same way.

Joining a cluster by address is bounded (`--connect-timeout`): Ray itself would retry a GCS that
never answers for many minutes. `ray.init` runs on a thread of its own, which lives until the
driver disconnects (a local cluster's processes die with the thread that started them), so the
main thread can give up at the deadline or on a stop request; afterwards the main thread takes
SIGINT and SIGTERM back from the handlers `ray.init` installs (Ray's own exits the driver at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import ray
from ray import exceptions as rex

from .. import __version__
from ..errors import ExitCode, RunError, first_line
from ..readers.slicing import Reading
from ..run.counters import Counters
from .job import LOST, JobResult, JobSpec, TaskOutcome, job_exit_code, merge_results
from .ray_tasks import ProgressBoard, TaskRetry, mmenc_check, mmenc_status, mmenc_task

log = logging.getLogger("mmenc")

Display = Callable[[Counters, str], None]
#: seconds between two looks at the tasks' progress
POLL = 0.5


def run_job(spec: JobSpec, display: Display, stop: threading.Event,
            signum: Callable[[], int | None] = lambda: None) -> JobResult:
    """Run the job on the cluster and gather it (see the module docstring); `stop` is set on a stop
    request, and `signum()` then says which signal made it."""
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # Ray echoes its workers' output: stdout is for --json
        outcomes, status, status_error = _run(spec, display, stop, signum)
    merged = merge_results(spec, outcomes, time.perf_counter() - t0)
    code, reason = job_exit_code(outcomes, merged, None if status is None else bool(status.ok), signum())
    return JobResult(tasks=outcomes, result=merged, status=status, status_error=status_error, code=code,
                     reason=reason, signum=signum())


def _run(spec: JobSpec, display: Display, stop: threading.Event,
         signum: Callable[[], int | None]) -> tuple[list[TaskOutcome], Any, str | None]:
    """Connect, check, submit, gather; the tasks' outcomes and the status after them."""
    connection = _connect(spec, stop, signum)
    try:
        _check_resources(spec)
        total = _preflight(spec, stop, signum)
        board = ProgressBoard.remote()  # type: ignore[attr-defined]
        refs = {mmenc_task.options(**_resources(spec), max_retries=spec.max_retries, retry_exceptions=[TaskRetry])
                .remote(spec.task_config(i), board): i for i in range(spec.tasks)}
        outcomes = _gather(spec, refs, board, display, stop, total)
        status, status_error = _status(spec)
    finally:
        ray.shutdown()
        connection.release.set()
    return outcomes, status, status_error


def _stopped(signum: Callable[[], int | None], when: str) -> RunError:
    """The stop request that ended the driver before any task ran, with its signal's exit code."""
    return RunError(f"stopped {when}: nothing ran; the same command again starts the job",
                    128 + (signum() or signal.SIGINT))


class _SigtermNote(logging.Filter):
    """Drops Ray's note that it set no SIGTERM handler off the main thread: the driver has its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


class Connection:
    """`ray.init` on a thread that lives until `release` is set (see the module docstring)."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.ready, self.release = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mmenc-ray-connect", daemon=True)

    def _run(self) -> None:
        try:
            ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=True)
        except BaseException as exc:  # handed to the main thread, which raises it
            self.error = exc
        finally:
            self.ready.set()
        self.release.wait()


def _connect(spec: JobSpec, stop: threading.Event, signum: Callable[[], int | None]) -> Connection:
    """Join the cluster at `spec.address`; without one, Ray's own rule: RAY_ADDRESS, else a cluster
    started on this machine with `ray start`, else a new local one for this job. Joining by address
    gives up after `spec.connect_timeout` seconds (exit 3); a stop request ends the wait at once."""
    target = spec.address or os.environ.get("RAY_ADDRESS") or None
    joins = target not in (None, "local")
    deadline = time.monotonic() + spec.connect_timeout
    if joins:
        _probe(target, deadline, lambda: _check_stop(stop, signum, spec.address))  # type: ignore[arg-type]
    quiet, noisy = _SigtermNote(), logging.getLogger("ray._private.worker")
    noisy.addFilter(quiet)
    handlers = _handlers()
    connection = Connection(spec.address)
    connection.thread.start()
    try:
        while not connection.ready.wait(0.1):
            _check_stop(stop, signum, spec.address)
            if joins and time.monotonic() > deadline:
                raise RunError(f"cannot reach the Ray cluster at {target}: no answer within {spec.connect_timeout:g} s "
                               "(--connect-timeout)", ExitCode.SETUP)
    finally:
        _restore(handlers)
        noisy.removeFilter(quiet)
    if connection.error is not None:
        connection.release.set()
        raise RunError(f"cannot reach the Ray cluster{_where(spec.address)}: {first_line(connection.error)}",
                       ExitCode.SETUP) from None
    return connection


def _check_stop(stop: threading.Event, signum: Callable[[], int | None], address: str | None) -> None:
    """A stop request while connecting ends the driver at once."""
    if stop.is_set():
        raise _stopped(signum, f"while connecting to the Ray cluster{_where(address)}")


def _where(address: str | None) -> str:
    return f" at {address}" if address else " (none given: RAY_ADDRESS, this machine's, or a new local one)"


def _probe(address: str, deadline: float, check_stop: Callable[[], None]) -> None:
    """A plain TCP connect to the cluster's HOST:PORT: a port nobody listens on fails here at once,
    with the system's reason, instead of at the deadline (an address that is no HOST:PORT is left
    to Ray). Tried in short steps, so a stop request ends an address that drops packets at once."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return
    while True:
        check_stop()
        step = min(0.5, deadline - time.monotonic())
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=max(step, 0.01)).close()
            return
        except TimeoutError:
            if time.monotonic() < deadline:
                continue
            why = "no answer"
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
        raise RunError(f"cannot reach the Ray cluster at {address}: {why}", ExitCode.SETUP) from None


def _handlers() -> dict[int, Any]:
    """This thread's SIGINT and SIGTERM handlers (none off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore(handlers: dict[int, Any]) -> None:
    """Put the driver's handlers back: `ray.init` replaces SIGTERM's (on the main thread, with an
    exit) and, in its core worker, the C-level handler under Python's (with a crash dump)."""
    for sig, handler in handlers.items():
        if handler is not None:  # None: not set from Python, nothing to put back
            signal.signal(sig, handler)


def _resources(spec: JobSpec) -> dict[str, Any]:
    return {"num_cpus": spec.cpus_per_task, "num_gpus": spec.gpus_per_task}


def _check_resources(spec: JobSpec) -> None:
    """Warn when no node of the cluster as it is now could run a task (an autoscaler may add one)."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not any(r.get("CPU", 0) >= spec.cpus_per_task and r.get("GPU", 0) >= spec.gpus_per_task for r in nodes):
        log.warning("no node of the Ray cluster has %s CPU(s) and %s GPU(s) for a task: the tasks wait until one "
                    "joins (--cpus-per-task, --gpus-per-task)", spec.cpus_per_task, spec.gpus_per_task)


def _wait_one(ref: Any, stop: threading.Event, signum: Callable[[], int | None]) -> Any:
    """`ray.get(ref)`, given up on a stop request (the task is cancelled)."""
    while not ray.wait([ref], timeout=POLL)[0]:
        if stop.is_set():
            ray.cancel(ref, force=True)
            raise _stopped(signum, "before the job started")
    return ray.get(ref)


def _preflight(spec: JobSpec, stop: threading.Event, signum: Callable[[], int | None]) -> Reading | None:
    """On one worker, where a task would run: this mmenc, the model, the inputs and OUT's filesystem;
    the job's size for its progress (None when not known)."""
    try:
        check = mmenc_check.options(**_resources(spec), max_retries=0).remote(__version__, spec.cfg, spec.tasks)
        answer = _wait_one(check, stop, signum)
    except rex.RayError as exc:
        raise RunError(f"cannot run mmenc on the Ray workers (is mmenc[ray] installed on every node?): "
                       f"{first_line(exc)}", ExitCode.SETUP) from None
    if isinstance(answer, tuple):
        code, why = answer
        raise RunError(why, code)
    return answer


def _gather(spec: JobSpec, refs: dict[Any, int], board: Any, display: Display,
            stop: threading.Event, total: Reading | None = None) -> list[TaskOutcome]:
    """Wait for every task, showing progress; cancel them all on a stop request or a --fail-fast stop."""
    outcomes: dict[int, TaskOutcome] = {}
    pending = dict(refs)
    cancelled = False
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL)
            for ref in ready:
                task = pending.pop(ref)
                outcomes[task] = _outcome(ref, task)
            stopped = spec.cfg.fail_fast and any(o.state == "stopped" for o in outcomes.values())
            if (stop.is_set() or stopped) and not cancelled:
                cancelled = _cancel(pending, force=False)
            display(*_progress(board, outcomes, spec.tasks, total))
    except KeyboardInterrupt:  # a second Ctrl-C: kill the workers now
        _cancel(pending, force=True)
        raise
    return _with_board(list(outcomes.values()), board)


def _cancel(pending: dict[Any, int], force: bool) -> bool:
    for ref in pending:
        ray.cancel(ref, force=force)
    return True


def _outcome(ref: Any, task: int) -> TaskOutcome:
    """How task `task` ended, from what `ray.get` says of it."""
    try:
        return ray.get(ref)  # type: ignore[no-any-return]
    except rex.TaskCancelledError:
        return TaskOutcome(task=task, code=130, state="cancelled")
    except (rex.WorkerCrashedError, rex.NodeDiedError, rex.OutOfMemoryError, rex.LocalRayletDiedError) as exc:
        return TaskOutcome(task=task, code=LOST, state="lost", error=f"its worker died ({first_line(exc)})")
    except rex.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, TaskRetry):
            if cause.code == 143:  # stopped by a signal (the driver's cancel, or the node's), whole shards committed
                return TaskOutcome(task=task, code=cause.code, state="interrupted")
            return TaskOutcome(task=task, code=cause.code, state="failed", error=cause.message)
        return TaskOutcome(task=task, code=int(ExitCode.INTERNAL), state="failed",
                           error=f"{type(cause).__name__}: {first_line(cause)}")
    except rex.RayError as exc:
        return TaskOutcome(task=task, code=int(ExitCode.INTERNAL), state="failed", error=first_line(exc))


def _snapshot(board: Any) -> dict[int, dict[str, Any]]:
    try:
        return ray.get(board.snapshot.remote(), timeout=30)  # type: ignore[no-any-return]
    except rex.RayError as exc:
        log.debug("progress board unavailable: %s", exc)
        return {}


def _progress(board: Any, outcomes: dict[int, TaskOutcome], tasks: int,
              total: Reading | None = None) -> tuple[Counters, str]:
    """The tasks' latest counts summed, and a note on where the tasks are; `total`, the job's size,
    stands for the slices of the tasks that have not reported yet (their share is not done)."""
    seen = _snapshot(board)
    counters = Counters()
    load = 0.0
    for entry in seen.values():
        if entry.get("counters") is not None:
            counters.merge(entry["counters"])
            load = max(load, entry["counters"].seconds.get("load", 0.0))
    counters.seconds["load"] = load  # the tasks load at once: the wall time it took, not the sum
    if total is not None:
        counters.reading = replace(total, done=counters.reading.done if counters.reading else 0)
    done = sum(1 for o in outcomes.values() if o.state == "done")
    running = sum(1 for t in seen if t not in outcomes)
    retried = sum(1 for e in seen.values() if e.get("attempts", 1) > 1)
    note = f"tasks {done}/{tasks} done, {running} running" + (f", {retried} retried" if retried else "")
    return counters, note


def _with_board(outcomes: list[TaskOutcome], board: Any) -> list[TaskOutcome]:
    """Attempts and hosts from the board; a cancelled task's result, which its return could not bring."""
    seen = _snapshot(board)
    for o in outcomes:
        entry = seen.get(o.task, {})
        o.attempts = int(entry.get("attempts", 0))
        o.host = o.host or entry.get("host")
        if o.result is None and entry.get("result") is not None:
            o.result = entry["result"]
    return sorted(outcomes, key=lambda o: o.task)


def _status(spec: JobSpec) -> tuple[Any, str | None]:
    """What `mmenc status OUT` says now, read on a worker; (None, why) when it cannot be read."""
    try:
        ref = mmenc_status.options(**_resources(spec), max_retries=1).remote(spec.cfg.writer.out, spec.cfg.writer.store_options)
        return ray.get(ref, timeout=300), None
    except rex.RayTaskError as exc:
        return None, f"{type(exc.cause).__name__}: {first_line(exc.cause)}"
    except rex.RayError as exc:
        return None, first_line(exc)
