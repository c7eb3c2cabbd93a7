"""`mmenc inspect OUT`: count embeddings per modality, show dim, dtype, model and shards; check every shard."""

from __future__ import annotations

import json

import typer

from ..errors import ExitCode
from .exits import fatal_errors
from .options import JsonOpt, OutArg, StorageOpt, opened
from .render import duplicates_line, echo_err, print_inspect


def inspect(out: OutArg, json_out: JsonOpt = False, storage_options: StorageOpt = None) -> None:
    """Count embeddings per modality, show dim, dtype, model and shards; check every shard (exit 3 on a
    problem, 4 on ids or items encoded twice)."""
    from ..output.inspect import inspect_output

    with fatal_errors():
        report = inspect_output(opened(out, storage_options))
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_inspect(str(out), report)
    for p in report.problems:
        echo_err(f"mmenc: problem: {p}")
    if report.duplicates:
        echo_err(f"mmenc: duplicates: {duplicates_line(report.duplicates)}")
    if report.problems:
        raise typer.Exit(ExitCode.SETUP)
    if report.duplicates:
        raise typer.Exit(ExitCode.THRESHOLD)
