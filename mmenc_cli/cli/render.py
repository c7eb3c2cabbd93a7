"""Human output: the encode summary, progress, and the tables of `inspect`, `errors` and `status`.

The only place that formats for people. Summaries and logs go to stderr; tables that are a
command's result go to stdout (and `--json` replaces them with one JSON document).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

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


class Progress:
    """A rich progress line on a terminal; plain log lines every `every` seconds otherwise.
    The rate leaves out the model load."""

    def __init__(self, mode: str, every: float) -> None:
        self.tty = sys.stderr.isatty() if mode == "auto" else mode == "bar"
        self.enabled = mode != "none"
        self.every = every
        self.t0 = time.monotonic()
        self.last = self.t0
        self.bar: Any = None

    def __call__(self, counters: "Counters", note: str = "") -> None:
        if not self.enabled:
            return
        done, failed = counters.encoded_now, counters.failed_now
        rate = done / max(1e-9, time.monotonic() - self.t0 - counters.seconds.get("load", 0.0))
        note = f"  {note}" if note else ""
        if self.tty:
            if self.bar is None:
                from rich.progress import Progress as Bar
                from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

                self.bar = Bar(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True)
                self.bar.start()
                self.task = self.bar.add_task("")
            self.bar.update(self.task, description=f"rows {counters.rows}  encoded {done}  failed {failed}  "
                                                   f"{rate:.1f} items/s{note}")
        elif time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            log.info("progress: rows %d, encoded %d, failed %d, %.1f items/s%s", counters.rows, done, failed, rate,
                     note.replace("  ", "; ", 1))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_inspect(out: str, report: "InspectReport") -> None:
    """`mmenc inspect`'s table on stdout."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(stderr=False)
    con.print(f"[bold]{escape(printable(out))}[/]: {plural(report.embeddings, 'embedding')} "
              + ", ".join(f"{k} {v}" for k, v in sorted(report.by_modality.items())))
    con.print(f"model {report.model} (revision {report.revision}), dim {report.dim}, "
              f"dtype {report.dtype}, format {report.format}")
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
        table.add_row(str(g["code"]), str(g["reason"]), str(g["stage"]), str(g["modality"] or "-"), str(g["count"]),
                      escape(printable(f"{g['example_id']}: {g['example']}"[:120])))
    Console().print(table)


def error_line(r: dict[str, Any]) -> str:
    """One failure of `mmenc errors list`, in a line."""
    where = f"{r.get('manifest')}:{r.get('line') or '@' + str(r.get('offset'))}"
    return printable(f"{r.get('code')} {r.get('reason')} [{r.get('stage')}/{r.get('modality') or '-'}] "
                     f"{r.get('id')} {where}: {r.get('message')}")


def print_status(r: "StatusReport", rerun_hint: str | None) -> None:
    """`mmenc status`'s table on stdout, then duplicates and the re-run hint."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    table = Table(title=f"{escape(r.out)}: {plural(r.task_count, 'task')}", title_justify="left", box=None,
                  padding=(0, 1), pad_edge=False)
    for name in ("task", "state", "encoded", "errors", "re-run", "updated"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("task", "encoded", "errors") else "left")
    for name in ("host", "note"):
        table.add_column(name, overflow="fold", min_width=6)
    for t in r.tasks:
        state = "crashed" if t.state == "running" and not t.running else t.state
        style = "green" if state == "done" and not t.needs_rerun else ("yellow" if t.running else "red")
        updated = (t.updated or "")[5:19].replace("T", " ")  # MM-DD HH:MM:SS
        table.add_row(str(t.task), f"[{style}]{state}[/]", str(t.encoded), str(t.errors),
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
