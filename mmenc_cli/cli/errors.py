"""`mmenc errors summary|list|retry OUT`: inspect the error reports of all tasks, build a retry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from .exits import fatal_errors
from .options import JsonOpt, OutArg, StorageOpt, opened
from .render import echo_err, error_line, plural, print_error_summary, word

errors_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Inspect failed items and turn them into a retry manifest.")

CodeOpt = Annotated[Optional[List[int]], typer.Option("--code", help="Only this HTTP-style code (repeatable).")]
ReasonOpt = Annotated[Optional[List[str]], typer.Option("--reason", help="Only this reason slug (repeatable).")]
StageOpt = Annotated[Optional[List[str]], typer.Option("--stage", help="Only this stage (repeatable).")]
JsonLinesOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object a line on stdout: JSON lines (for scripts).")]
ModalityOpt = Annotated[Optional[List[str]], typer.Option("--modality", help="image, text, audio, video, or none for rows that are not valid (repeatable).")]
GrepOpt = Annotated[Optional[str], typer.Option("--grep", help="Only rows containing this text (case-insensitive).")]


def _rows(out: Any, code, reason, stage, modality, grep) -> list[dict]:
    from ..error_rows import filter_errors, latest_errors

    with fatal_errors():
        damaged: list[str] = []
        rows = filter_errors(latest_errors(out, damaged), code, reason, stage, modality, grep)
    for problem in damaged:
        echo_err(f"mmenc: warning: {problem}, skipped")
    return rows


@errors_app.command()
def summary(out: OutArg, json_out: JsonOpt = False, code: CodeOpt = None, reason: ReasonOpt = None,
            stage: StageOpt = None, modality: ModalityOpt = None, grep: GrepOpt = None,
            storage_options: StorageOpt = None) -> None:
    """A table of current failures by code, reason, stage and modality, with an example each."""
    from ..error_rows import summarize

    s = summarize(_rows(opened(out, storage_options), code, reason, stage, modality, grep))
    if json_out:
        typer.echo(json.dumps(s, indent=2))
    else:
        print_error_summary(str(out), s)


@errors_app.command("list")
def list_(out: OutArg, json_out: JsonLinesOpt = False, code: CodeOpt = None, reason: ReasonOpt = None,
          stage: StageOpt = None, modality: ModalityOpt = None, grep: GrepOpt = None,
          storage_options: StorageOpt = None) -> None:
    """The current failures, one per item (--json: JSON lines)."""
    from ..error_rows import json_line

    rows = _rows(opened(out, storage_options), code, reason, stage, modality, grep)
    for r in rows:
        typer.echo(json_line(r) if json_out else error_line(r))


@errors_app.command()
def retry(out: OutArg, output: Annotated[Path, typer.Option("--output", "-o", help="Retry manifest to write (JSONL).")],
          code: CodeOpt = None, reason: ReasonOpt = None, stage: StageOpt = None, modality: ModalityOpt = None,
          grep: GrepOpt = None, storage_options: StorageOpt = None) -> None:
    """Write the original rows of the failed items (failed modalities only) as a JSONL manifest.

    Then `mmenc encode RETRY.jsonl --out OUT` (same options) encodes what now succeeds into OUT.
    """
    from ..error_rows import retryable_whole, write_retry

    od = opened(out, storage_options)
    rows = _rows(od, code, reason, stage, modality, grep)
    whole = sum(1 for r in rows if retryable_whole(r))
    skipped = sum(1 for r in rows if r.get("modality") is None) - whole
    with fatal_errors():
        n = write_retry(od, rows, output)
    echo_err(f"mmenc: wrote {plural(n, 'row')} to {output}"
             + (f"; {plural(skipped, 'invalid row')} cannot be retried (fix the input)" if skipped else "")
             + (f"; {plural(whole, 'sample')} over --max-row-bytes {word(whole, 'is', 'are')} written whole: encode "
                f"{word(whole, 'it', 'them')} with a larger --max-row-bytes" if whole else ""))
