"""The `mmenc` Typer app: one command or group per module of this package.

    mmenc encode ...            encode.py
    mmenc inspect OUT           inspect.py
    mmenc errors summary|list|retry OUT    errors.py
    mmenc export vllm OUT DEST  export.py
    mmenc slurm ...             slurm.py
    mmenc status OUT            status.py

Importing the app is cheap (`mmenc --help` < 0.5 s): each command imports the core it calls when
it runs, so torch and transformers load only for `encode`.
"""

from __future__ import annotations

import typer

from . import encode, errors, export, inspect, slurm, status

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,  # option help holds [default: ...] and mmenc[gpu]: not markup
                  help="Batch-encode images and texts into embeddings, offline, without losing a row.")
app.command("encode")(encode.encode)
app.command("inspect")(inspect.inspect)
app.add_typer(errors.errors_app, name="errors")
app.add_typer(export.export_app, name="export")
slurm.register(app)
app.command("status")(status.status)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="mmenc")
