"""Exit codes: each run-level exception type carries its own (`errors.RunError.exit_code`).

    0  the input is fully accounted for within the error threshold
    1  internal error (one line; MMENC_DEBUG=1 shows the traceback)
    2  usage error
    3  fatal setup error: model cannot load, output not writable, options that conflict with the
       output, unreadable manifest, sbatch missing or failing
    4  error threshold exceeded, --fail-fast stopped the run, or `mmenc status` found work left
   75  another live run holds this task's lock on OUT (EX_TEMPFAIL)
  130  interrupted by SIGINT, 143 by SIGTERM (resumable: re-run the same command)
  `mmenc ray` also exits with the code of its first task that still failed after its retries
  (137: the task's worker or node died every time); engines/job.py has the order
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import typer

from ..errors import ExitCode, RunError, printable
from ..stopping import cut_short, stop_exit_code

__all__ = ["ExitCode", "exit_code_for", "fail", "fatal_errors"]


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a run-level exception: its own for a `RunError`, else internal (1); the
    signal's (130/143) when a stop request cut a wait on the store short, whatever ended the run."""
    if cut_short():
        return stop_exit_code()
    return int(exc.exit_code) if isinstance(exc, RunError) else int(ExitCode.INTERNAL)


def _store_fault(exc: BaseException) -> BaseException:
    """A store client's own error (wrong credentials, an endpoint that cannot be reached) as the
    output fault it is (exit 3); anything else as it is."""
    from ..output.objectstore import store_fault

    return store_fault(exc) or exc


def fail(message: str, code: int) -> typer.Exit:
    """Print one line on stderr and return the Exit to raise."""
    typer.echo(printable(f"mmenc: error: {message}"), err=True)
    return typer.Exit(code)


@contextlib.contextmanager
def fatal_errors() -> Iterator[None]:
    """Turn an exception into one line on stderr and its exit code (traceback with MMENC_DEBUG=1)."""
    try:
        yield
    except typer.Exit:
        raise
    except Exception as exc:
        if os.environ.get("MMENC_DEBUG") == "1":
            raise
        exc = _store_fault(exc)
        code = exit_code_for(exc)
        if cut_short():
            raise fail(f"stopped while waiting for the store: {exc}", code) from None
        if code == ExitCode.INTERNAL:
            raise fail(f"internal error: {type(exc).__name__}: {exc} (MMENC_DEBUG=1 shows the traceback)",
                       code) from None
        raise fail(str(exc), code) from None
