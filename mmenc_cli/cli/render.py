"""Human output: the encode summary, progress, and the tables of `inspect`, `errors` and `status`.

The only place that formats for people. Summaries and logs go to stderr; tables that are a
command's result go to stdout (and `--json` replaces them with one JSON document).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import typer

from ..errors import printable

if TYPE_CHECKING:  # pragma: no cover
    from ..engines.job import JobResult, TaskOutcome
    from ..output.inspect import InspectReport
    from ..run.counters import Counters, ModalityStats, RunResult
    from ..output.status import StatusReport

log = logging.getLogger("mmenc")

#: what each failure code means, in the summary's words
CODE_WORDS = {400: "bad input", 403: "forbidden", 404: "not found", 409: "duplicate id", 413: "too large",
              415: "unsupported", 422: "unusable input", 500: "failed in mmenc", 503: "unavailable",
              504: "timed out", 507: "out of memory"}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a line is logged (a test runner or an application
    embedding the CLI may swap it between commands)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging(verbose: bool = False) -> None:
    """Log lines on stderr; DEBUG with --verbose (set again by every command)."""
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s mmenc %(levelname)s: %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def word(n: int, singular: str, plural_form: str | None = None) -> str:
    """The form of a noun (or verb) that agrees with the count `n`: "row" for 1, "rows" otherwise;
    `plural_form` where adding an s is wrong ("has", "have")."""
    return singular if n == 1 else (plural_form or singular + "s")


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """A count with its noun in agreement: "1 task", "2 tasks", "0 failed items"."""
    return f"{n} {word(n, noun, plural_form)}"


def _some(*parts: tuple[int, str]) -> str:
    """', '-joined phrases whose count is not zero."""
    return ", ".join(text for n, text in parts if n)


def _held(m: "ModalityStats") -> bool:
    """True when some row of the run holds this modality (an item asked for, now or earlier)."""
    return bool(m.requested or m.encoded or m.encoded_before or m.failed or m.failed_before or m.not_attempted)


def summary_lines(result: "RunResult", verbose: bool = False) -> list[str]:
    """The end-of-run summary: what happened at a glance; zeros left out, and the modalities no
    row holds; what was skipped said as the rows without a modality."""
    c = result.counters
    failed_items = sum(m.failed_total for m in c.modalities.values())
    done = f"{result.state} after " if result.state != "done" else ""
    lacking = [(m.skipped, f"{plural(m.skipped, 'row')} {word(m.skipped, 'has', 'have')} no {name}")
               for name, m in sorted(c.modalities.items())]
    head = _some((c.encoded_now, f"{plural(c.encoded_now, 'item')} encoded"),
                 (failed_items, f"{plural(failed_items, 'item')} failed"),
                 (c.invalid, plural(c.invalid, "invalid row")),
                 (c.not_downloaded, f"{c.not_downloaded} not downloaded"), *lacking) or "nothing to do"
    if result.state == "interrupted" and not c.rows:
        return [f"mmenc: interrupted while starting (before the first row; the model may have been loading) -> "
                f"{result.out} in {result.elapsed:.1f} s: nothing encoded; run the same command again to start"]
    lines = [f"mmenc: {done}{plural(c.rows, 'row')} -> {result.out} in {result.elapsed:.1f} s: {head}"]
    for name, m in sorted(c.modalities.items()):
        if not _held(m):
            continue
        truncated = f" ({m.truncated} truncated)" if m.truncated else ""
        parts = _some((m.failed_total, f"{m.failed_total} failed"),
                      (m.encoded_before, f"{m.encoded_before} encoded earlier"),
                      (m.failed_before, f"{m.failed_before} failed earlier, not retried"),
                      (m.not_attempted, f"{m.not_attempted} not attempted"))
        lines.append(f"  {name:5s}  {m.encoded} encoded{truncated}" + (f", {parts}" if parts else ""))
    lines += _failure_lines(c, result.out)
    if c.not_attempted:
        lines.append(f"  {plural(c.not_attempted, 'item')} not attempted: re-run the same command to finish "
                     + word(c.not_attempted, "it", "them"))
    if not result.model_loaded and c.requested:
        lines.append("  nothing new to encode: the model was not loaded")
    if result.threshold_exceeded:
        lines.append(f"  error threshold exceeded: {result.threshold_exceeded}")
    if not c.balanced:
        lines.append(f"  ACCOUNTING ERROR: requested {c.requested} + invalid {c.invalid + c.invalid_before} != "
                     f"encoded {c.encoded} + failed {c.failed} + not attempted {c.not_attempted}")
    if verbose:
        lines.append(_seconds_line(result))
    return lines


def job_lines(job: "JobResult", verbose: bool = False) -> list[str]:
    """`mmenc ray`'s end: the summary across tasks, the tasks that did not simply finish, what
    `mmenc status` says of OUT now, and why the exit code is not 0."""
    lines = summary_lines(job.result, verbose)
    by_state: dict[str, int] = {}
    for t in job.tasks:
        by_state[t.state] = by_state.get(t.state, 0) + 1
    retried = sum(1 for t in job.tasks if t.attempts > 1)
    lines.append(f"  {plural(len(job.tasks), 'task')}: " + ", ".join(f"{n} {s}" for s, n in sorted(by_state.items()))
                 + (f" ({retried} retried)" if retried else ""))
    lines += [_task_line(t) for t in job.tasks if t.state != "done" or t.attempts > 1][:MAX_TASK_LINES]
    lines += _status_lines(job)
    if job.code:
        lines.append(f"  exit {job.code}: {job.reason}")
    return lines


#: tasks named one per line at the end of `mmenc ray` (the others are counted)
MAX_TASK_LINES = 20


def _task_line(t: "TaskOutcome") -> str:
    retries = max(0, t.attempts - 1)
    return (f"  task {t.task} {t.state}" + (f" (exit {t.code})" if t.code else "")
            + (f" after {plural(retries, 'retry', 'retries')}" if retries else "")
            + (f" on {t.host}" if t.host else "") + (f": {t.error}" if t.error else ""))


def _status_lines(job: "JobResult") -> list[str]:
    """What `mmenc status OUT` says after the job, in a few lines."""
    s = job.status
    if s is None:
        return ["  mmenc status: not read" + (f" ({job.status_error})" if job.status_error else "")]
    if s.ok:
        return [f"  mmenc status: all {plural(s.task_count, 'task')} done, no duplicates"]
    lines = []
    if s.rerun:
        lines.append(f"  mmenc status: {word(len(s.rerun), 'task')} {','.join(map(str, s.rerun))} "
                     f"{word(len(s.rerun), 'needs', 'need')} a re-run: run the same command again to resume")
    if s.duplicates:
        lines.append(f"  mmenc status: duplicates: {duplicates_line(s.duplicates)}")
    lines += [f"  mmenc status: {p}" for p in s.problems[:5]]
    return lines or [f"  mmenc status: not done (see mmenc status {s.out})"]


def _failure_lines(c: "Counters", out: str) -> list[str]:
    """A line per failure code (items and invalid lines of this run), then where to look."""
    codes: dict[int, int] = {}
    for m in c.modalities.values():
        for code, n in m.failed.items():
            codes[code] = codes.get(code, 0) + n
    lines = [f"  {code} {CODE_WORDS.get(code, 'failed')}: {n}" for code, n in sorted(codes.items())]
    if c.invalid:
        lines.append(f"  invalid rows (lines, samples, shards): {c.invalid}")
    if c.invalid_before:
        lines.append(f"  invalid rows earlier: {c.invalid_before}")
    if lines:
        lines.append(f"  see: mmenc errors summary {out}")
    return lines


def _seconds_line(result: "RunResult") -> str:
    """Throughput (the model load left out) and seconds per stage."""
    c = result.counters
    secs = c.seconds
    loop = max(1e-9, result.elapsed - secs.get("load", 0.0))
    return (f"  {c.encoded_now / loop:.1f} items/s without the model load; seconds: model load {secs.get('load', 0):.2f}, "
            f"read {secs.get('read', 0):.2f}, decode {secs.get('decode', 0):.2f} (worker time), "
            f"tokenize {secs.get('tokenize', 0):.2f}, encode {secs.get('encode', 0):.2f}, write {secs.get('write', 0):.2f}")


def eta_text(seconds: float) -> str:
    """The time left as progress shows it: `ETA 45s`, `ETA 3m12s`, `ETA 1h02m`."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"ETA {s}s"
    if s < 3600:
        return f"ETA {s // 60}m{s % 60:02d}s"
    return f"ETA {s // 3600}h{s % 3600 // 60:02d}m"


class WindowRate:
    """The rate of a growing count over about the last `window` seconds, so an ETA follows the
    recent pace (a model load or a slow start fades out of it). Samples are kept `step` seconds
    apart, the newest replacing the last within a step: a few hundred at most."""

    def __init__(self, window: float = 45.0, clock: Callable[[], float] = time.monotonic, step: float = 0.5) -> None:
        self.window, self.clock, self.step = window, clock, step
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, done: int) -> None:
        """Note the count now."""
        now = self.clock()
        if len(self.samples) >= 2 and now - self.samples[-2][0] < self.step:
            self.samples[-1] = (now, done)
        else:
            self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()  # the oldest kept is the last one a window old

    def rate(self) -> float | None:
        """Counts per second over the window; None before two samples or while nothing moved."""
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 and d1 > d0 else None


def work_text(progress: dict[str, Any] | None, rate: WindowRate) -> str:
    """`45.2%, ETA 3m12s` from a task's `Counters.progress` and the window's rate ("" when the
    size of the work is unknown; no ETA before the rate is)."""
    if progress is None:
        return ""
    done, total = progress["done"], progress["total"]
    rate.add(done)
    pct = 100.0 if total <= 0 else 100.0 * done / total
    per_s = rate.rate()
    eta = eta_text(0) if done >= total else (eta_text((total - done) / per_s) if per_s else "")
    return f"{pct:.1f}%" + (f", {eta}" if eta else "")


class Progress:
    """A rich progress line on a terminal; plain log lines every `every` seconds otherwise. Where
    the size of the work is known, the percentage done and an ETA from the recent rate. The
    items/s rate leaves out the model load."""

    def __init__(self, mode: str, every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.tty = sys.stderr.isatty() if mode == "auto" else mode == "bar"
        self.enabled = mode != "none"
        self.every, self.clock = every, clock
        self.t0 = clock()
        self.last = self.t0
        self.bar: Any = None
        self.window = WindowRate(clock=clock)

    def __call__(self, counters: "Counters", note: str = "") -> None:
        if not self.enabled:
            return
        done, failed = counters.encoded_now, counters.failed_now
        rate = done / max(1e-9, self.clock() - self.t0 - counters.seconds.get("load", 0.0))
        progress = counters.progress
        work = work_text(progress, self.window)
        if self.tty:
            self._bar(f"rows {counters.rows}  encoded {done}  failed {failed}  {rate:.1f} items/s"
                      + (f"  {work.replace(', ', '  ')}" if work else "") + (f"  {note}" if note else ""), progress)
        elif self.clock() - self.last >= self.every:
            self.last = self.clock()
            log.info("progress: rows %d, encoded %d, failed %d, %.1f items/s%s%s", counters.rows, done, failed, rate,
                     f", {work}" if work else "", f"; {note}" if note else "")

    def _bar(self, text: str, progress: dict[str, Any] | None) -> None:
        """The terminal's line: a bar where the total is known, else a spinner (as before)."""
        if self.bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            columns = [SpinnerColumn()] + ([BarColumn()] if progress is not None else [])
            self.bar = Bar(*columns, TextColumn("{task.description}"), TimeElapsedColumn(), transient=True,
                           console=Console(stderr=True))  # progress goes to stderr; stdout is for results
            self.bar.start()
            self.task = self.bar.add_task("", total=None)
        if progress is not None:
            total = progress["total"]
            self.bar.update(self.task, total=max(total, 1), completed=progress["done"] if total else 1)
        self.bar.update(self.task, description=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_inspect(out: str, report: "InspectReport") -> None:
    """`mmenc inspect`'s table on stdout."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(stderr=False)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(report.by_modality.items()))
    con.print(f"[bold]{escape(printable(out))}[/]: {plural(report.embeddings, 'embedding')}"
              + (f" ({counts})" if counts else ""), soft_wrap=True)
    con.print(f"  model     {escape(printable(str(report.model or '-')))}", soft_wrap=True)
    con.print(f"  revision  {escape(str(report.revision or '-'))}", soft_wrap=True)
    con.print(f"  dim {report.dim or '-'}, dtype {report.dtype or 'float32'}, format {report.format or '-'}")
    table = Table("shard", "rows", "ok")
    for s in report.shards:
        table.add_row(s["name"], str(s["rows"]), "yes" if s["ok"] else f"NO: {s.get('error')}")
    con.print(table)


def print_error_summary(out: str, s: dict[str, Any]) -> None:
    """`mmenc errors summary`'s table on stdout."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table("code", "reason", "stage", "modality", "count", "example",
                  title=escape(printable(f"{plural(s['errors'], 'failed item')} in {out}")))
    for g in s["groups"]:
        example = g["example_id"] if g["example_id"] is not None else "(no id)"
        table.add_row(str(g["code"]), str(g["reason"]), str(g["stage"] or "-"), str(g["modality"] or "-"),
                      str(g["count"]), escape(printable(f"{example}: {g['example']}"[:120])))
    Console().print(table)


def error_place(r: dict[str, Any]) -> str:
    """Where a failure's row is: a manifest's line, a tar's or folder's member, a row's offset."""
    manifest = r.get("manifest") or "(no input)"
    if r.get("line"):
        return f"{manifest}:{r['line']}"
    if r.get("key"):
        return f"{manifest} member {r['key']}"
    return f"{manifest} offset {r['offset']}" if r.get("offset") is not None else manifest


def error_line(r: dict[str, Any]) -> str:
    """One failure of `mmenc errors list`, in a line."""
    shown = r.get("id") if r.get("id") is not None else "(no id)"
    return printable(f"{r.get('code')} {r.get('reason')} [{r.get('stage') or '-'}/{r.get('modality') or '-'}] "
                     f"{shown} {error_place(r)}: {r.get('message')}")


def print_status(r: "StatusReport", rerun_hint: str | None) -> None:
    """`mmenc status`'s table on stdout, then duplicates and the re-run hint."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    table = Table(title=f"{escape(r.out)}: {plural(r.task_count, 'task')}", title_justify="left", box=None,
                  padding=(0, 1), pad_edge=False)
    for name in ("task", "state", "done", "encoded", "errors", "re-run", "updated"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("task", "done", "encoded", "errors") else "left")
    for name in ("host", "note"):
        table.add_column(name, overflow="fold", min_width=6)
    for t in r.tasks:
        state = "crashed" if t.state == "running" and not t.running else t.state
        style = "green" if state == "done" and not t.needs_rerun else ("yellow" if t.running else "red")
        updated = (t.updated or "")[5:19].replace("T", " ")  # MM-DD HH:MM:SS
        done = f"{t.percent:.1f}%" if t.percent is not None and t.state == "running" else ""  # how far it got
        table.add_row(str(t.task), f"[{style}]{state}[/]", done, str(t.encoded), str(t.errors),
                      "[red]yes[/]" if t.needs_rerun else "", updated, escape(t.host or ""), escape(t.reason or ""))
    con.print(table)
    for problem in r.problems:
        con.print(f"[red]problem[/]: {escape(printable(problem))}", soft_wrap=True)
    d = r.duplicates
    if d:
        con.print(f"[red]duplicates[/]: {escape(duplicates_line(d))}: each is encoded twice; keep one per id "
                  "when reading, or re-encode into a new --out", soft_wrap=True)
    if r.all_done and not r.problems and not d:
        con.print("[green]all tasks done[/]")
    if rerun_hint:
        con.print(escape(rerun_hint), soft_wrap=True)


def duplicates_line(d: Any) -> str:
    """What `status` and `inspect` say of an output's duplicates (`status.Duplicates`)."""
    ex = printable(", ".join(f"{e['id']!r}/{e['modality']} in tasks {e['tasks']}" for e in d.examples))
    return (f"{plural(d.count, '(id, modality) pair')} in several tasks, {d.within_task} repeated within a task, "
            f"{plural(d.ids, 'id')} encoded from more than one row" + (f"; e.g. {ex}" if ex else ""))


def echo_err(text: str) -> None:
    """One or more lines on stderr."""
    typer.echo(printable(text), err=True)
