"""A job of N tasks over one output, run by an engine: what the driver sends, what each task comes
back with, and how the tasks' outcomes become one result and one exit code. No Ray, no torch.

A task's own code (`task_code`): 0 done; 4 stopped by `--fail-fast`; 1 when its counts do not
balance (a bug); a `RunError`'s code when it fails as a whole (2 usage, 3 output fault or model
that cannot load). Tasks run without the error thresholds: `--max-errors` and `--max-error-rate`
apply to the job, across tasks, once every task is back. Codes in `RETRIED` (a device error 1, 75
another live runner holds the slice, 143 the task's worker was told to stop) are handed back to
the engine to retry, as are workers and nodes that die; after `--max-retries` retries a task
still failing ends with its last code, or `LOST` (137) when its worker or node died every time.

The job's exit code (`job_exit_code`), the first that applies:

    128+N  the driver was stopped by signal N (Ctrl-C 130, SIGTERM 143): its tasks were cancelled,
           each commits whole shards; the same command again resumes
    code   of the lowest-numbered task that ended with neither 0 nor 4 after its retries
           (1, 2, 3, 75 or 137)
    1      the job's counts do not balance (a bug)
    4      a task stopped by --fail-fast, the job past --max-errors / --max-error-rate, or
           `mmenc status` not ok after the job (duplicates, damage, a task left to re-run)
    0      every task done, within the thresholds
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import ExitCode
from ..run.counters import Counters, RunResult, threshold_exceeded

if TYPE_CHECKING:  # pragma: no cover
    from ..config import RunConfig

#: the most (tasks x sources) a job's size is computed for (`job_size`: a pass over the sources a task)
SIZED_UP_TO = 2_000_000
#: the code of a task whose worker or node died on every attempt (as a shell reports a SIGKILL)
LOST = 137
#: the codes a task hands back to the engine to retry (a failed device, a live runner, a stop)
RETRIED = frozenset({int(ExitCode.INTERNAL), int(ExitCode.LOCKED), 143})
#: task states that are no failure of the task (one cancelled by the driver after a --fail-fast stop)
FINE = ("done", "stopped", "cancelled")


@dataclass(frozen=True)
class JobSpec:
    """One job: the encode config (task 0's, with the job's thresholds), the task count, what each
    task asks of the engine, where the engine is and how long to try reaching it (seconds)."""

    cfg: "RunConfig"
    tasks: int
    cpus_per_task: int = 1
    gpus_per_task: float = 0.0
    max_retries: int = 3
    address: str | None = None
    connect_timeout: float = 30.0

    def task_config(self, index: int) -> "RunConfig":
        """Task `index`'s config: no thresholds of its own (the job's apply across tasks), and a
        slice held by another live runner is waited for, then resumed."""
        return replace(self.cfg, task_index=index, task_count=self.tasks, max_errors=None, max_error_rate=None,
                       wait_lock=True, overwrite=False)


@dataclass
class TaskOutcome:
    """How one task ended: its code (0 done), state (done, stopped, interrupted, failed, lost,
    cancelled), its run's result where it came back, why it failed, attempts, where it ran last."""

    task: int
    code: int
    state: str
    result: RunResult | None = None
    error: str | None = None
    attempts: int = 1
    host: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (the task's counts, not its whole result)."""
        return {"task": self.task, "code": self.code, "state": self.state, "error": self.error,
                "attempts": self.attempts, "host": self.host,
                "counters": self.result.counters.to_dict() if self.result is not None else None}


@dataclass
class JobResult:
    """The job as a whole: its tasks, their merged result, what `mmenc status` says after it (or why
    it could not be read), and the exit code with its reason."""

    tasks: list[TaskOutcome]
    result: RunResult
    status: Any = None
    status_error: str | None = None
    code: int = 0
    reason: str | None = None
    signum: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy: `mmenc ray --json`'s result."""
        status = self.status.to_dict() if self.status is not None else None
        return {**self.result.to_dict(), "tasks": [t.to_dict() for t in self.tasks], "status": status,
                "status_error": self.status_error, "exit_code": self.code, "reason": self.reason}


def task_code(result: RunResult) -> int:
    """The exit code of one task's run (`mmenc encode`'s, without thresholds or signals)."""
    if not result.counters.balanced:
        return int(ExitCode.INTERNAL)
    if result.state == "stopped":
        return int(ExitCode.THRESHOLD)
    if result.state == "interrupted":
        return 143
    return int(ExitCode.OK)


def merge_results(spec: JobSpec, outcomes: list[TaskOutcome], elapsed: float) -> RunResult:
    """One result for the job: the counts of every task that came back, summed; the job's
    thresholds judged on them."""
    counters = Counters()
    results = [o.result for o in sorted(outcomes, key=lambda o: o.task) if o.result is not None]
    for r in results:
        counters.merge(r.counters)
    states = {o.state for o in outcomes}
    state = "done" if states <= {"done"} else next(
        (s for s in ("stopped", "interrupted", "cancelled") if s in states), "failed")
    return RunResult(out=spec.cfg.writer.out, task=-1, state="interrupted" if state == "cancelled" else state,
                     counters=counters, facts=results[0].facts if results else {}, elapsed=elapsed,
                     threshold_exceeded=threshold_exceeded(spec.cfg, counters),
                     model_loaded=any(r.model_loaded for r in results))


def job_exit_code(outcomes: list[TaskOutcome], merged: RunResult, status_ok: bool | None = None,
                  signum: int | None = None) -> tuple[int, str | None]:
    """The job's exit code and why (see the module docstring); `status_ok` None when the status
    was not read."""
    if signum is not None:
        return 128 + signum, "stopped by a signal: re-run the same command to resume"
    failed = sorted((o for o in outcomes if o.state not in FINE), key=lambda o: o.task)
    if failed:
        first = failed[0]
        return first.code, f"task {first.task} {first.state}" + (f": {first.error}" if first.error else "")
    if not merged.counters.balanced:
        return int(ExitCode.INTERNAL), "the job's counts do not balance"
    stopped = [o.task for o in outcomes if o.state == "stopped"]
    if stopped:
        return int(ExitCode.THRESHOLD), f"task {stopped[0]} stopped at its first failed item (--fail-fast)"
    if merged.threshold_exceeded:
        return int(ExitCode.THRESHOLD), f"error threshold exceeded: {merged.threshold_exceeded}"
    if status_ok is False:
        return int(ExitCode.THRESHOLD), "mmenc status finds work left or problems (see above)"
    return int(ExitCode.OK), None


def job_size(sources: list[Any], cfg: "RunConfig", tasks: int) -> Any:
    """The size of a job's work, every task's slice (`readers.work_size`) summed, as a `Reading` with
    nothing done: what its progress is a share of. None when a slice's size is not known."""
    from ..readers.slicing import work_size

    if tasks * max(1, len(sources)) > SIZED_UP_TO:  # each slice is a pass over the sources: too dear
        return None
    sizes = [work_size(sources, cfg.manifest, i, tasks) for i in range(tasks)]
    if not sizes or any(s.total is None for s in sizes):
        return None
    return replace(sizes[0], total=sum(s.total or 0 for s in sizes), done=0)
