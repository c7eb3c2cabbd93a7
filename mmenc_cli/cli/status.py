"""`mmenc status OUT`: per task, done or not, items, errors, which tasks need a re-run; duplicated ids."""

from __future__ import annotations

import json
import shlex
from typing import Annotated, Any

import typer

from ..errors import ExitCode
from .exits import fatal_errors
from .options import JsonOpt, OutArg, StorageOpt, opened
from .render import print_status, word


def status(out: OutArg, json_out: JsonOpt = False,
           examples: Annotated[int, typer.Option(min=0, help="Example duplicated ids to show.")] = 5,
           storage_options: StorageOpt = None) -> None:
    """Show per task: done or not, items encoded, errors, running, and which tasks need a re-run; and duplicated ids.

    Exit codes: 0 every task done and no duplicated ids; 4 otherwise (a task not done, running,
    needing a re-run, or duplicates); 3 OUT is not an mmenc output.
    """
    from ..output.status import collect_status

    with fatal_errors():
        report = collect_status(opened(out, storage_options), examples=examples)
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_status(report, _rerun_hint(report))
    if not report.ok:
        raise typer.Exit(ExitCode.THRESHOLD)


def _rerun_hint(report: Any) -> str | None:
    """The command that re-runs the tasks needing it: the latest sbatch script's, else encode's."""
    from ..slurm import latest_script

    if not report.rerun:
        return None
    tasks = ",".join(map(str, report.rerun))
    what = f"re-run {word(len(report.rerun), 'task')} {tasks}"
    script = latest_script(report.out)
    if script:
        return f"{what}: sbatch --array={tasks} {shlex.quote(str(script))}"
    if report.task_count == 1:
        return f"{what}: run the same mmenc encode command again (it encodes only what is missing)"
    index = tasks if len(report.rerun) == 1 else f"<each of {tasks}>"
    return f"{what}: mmenc encode ... --task-count {report.task_count} --task-index {index}"
