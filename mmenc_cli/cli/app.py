"""The `mmenc` Typer app: one command or group per module of this package.

    mmenc encode ...            encode.py
    mmenc inspect OUT           inspect.py
    mmenc errors summary|list|retry OUT    errors.py
    mmenc export vllm OUT DEST  export.py
    mmenc slurm ...             slurm.py
    mmenc ray ...               ray.py (Ray itself imported only when it runs)
    mmenc status OUT            status.py

Importing the app is cheap (`mmenc --help` < 0.5 s): each command imports the core it calls when
it runs, so torch and transformers load only for `encode`.
"""

from __future__ import annotations

import sys

import typer

from . import encode, errors, export, inspect, ray, slurm, status

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # option help holds [default: ...] and mmenc[gpu]: not markup
                  help="Batch-encode images, texts, audio and video into embeddings, offline, without losing a row.")


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"mmenc {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print mmenc's version and exit.")) -> None:
    """Batch-encode images, texts, audio and video into embeddings, offline, without losing a row."""


app.command("encode")(encode.encode)
app.command("inspect")(inspect.inspect)
app.add_typer(errors.errors_app, name="errors")
app.add_typer(export.export_app, name="export")
slurm.register(app)
ray.register(app)
app.command("status")(status.status)


def main() -> None:
    """Console-script entry point. A command that opened an object store ends right after its
    output is flushed: pyarrow (26) can abort at interpreter shutdown ("terminate called without
    an active exception") once it has read a shard through a store's Python file object; the exit
    code is the command's, not that abort's. Other commands end normally (atexit handlers run)."""
    try:
        app(prog_name="mmenc")  # standalone: usage errors and every exit code end in SystemExit
        code = 0
    except SystemExit as exc:
        if not _opened_a_store():
            raise
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if _opened_a_store():
        _exit_now(code)
    sys.exit(code)


def _opened_a_store() -> bool:
    store = sys.modules.get("mmenc_cli.output.objectstore")
    return bool(store is not None and store.OPENED)


def _exit_now(code: int) -> None:
    import logging
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)
