"""Commands that run `mmenc encode` for the user (`mmenc slurm`, `mmenc ray`) take its options after
`--`: kept verbatim, parsed once up front (a typo fails before anything is written or submitted),
and checked for what the engine sets itself and for secrets, which must not travel with a task."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand

from ..errors import ConfigError, ExitCode
from ..slurm import RESERVED_ENCODE_OPTIONS
from .encode import default_model
from .exits import fail
from .options import secret_storage_options
from .render import echo_err

_ENCODE_ARGS = "mmenc.encode_args"


class EncodeArgsCommand(TyperCommand):
    """Everything after `--` is kept verbatim as `mmenc encode` options (click would take it as
    more MANIFEST arguments)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta[_ENCODE_ARGS] = args[cut + 1:]
            args = args[:cut]
        try:
            return super().parse_args(ctx, args)
        except Exception as exc:
            if type(exc).__name__ == "NoSuchOption" and isinstance(getattr(exc, "message", None), str):
                exc.message += " (mmenc encode options go after --, e.g. -- --batch-size 64)"
            raise


def encode_args(ctx: typer.Context) -> list[str]:
    """The encode options given after `--`."""
    return list(ctx.meta.get(_ENCODE_ARGS, []))


def parse_encode_args(ctx: typer.Context, argv: list[str]) -> dict[str, Any]:
    """Parse an encode command line now, so a typo fails here and not in every task; its
    parameters by name (exit 2 on a usage error)."""
    from .encode import encode as encode_function

    group = ctx.parent.command if ctx.parent is not None else None
    get_command = getattr(group, "get_command", None)
    command = get_command(ctx.parent, "encode") if get_command else None
    if command is None:  # the command run on its own (tests): encode's parser all the same
        single = typer.Typer()
        single.command()(encode_function)
        command = typer.main.get_command(single)
    try:
        return dict(command.make_context("encode", list(argv), parent=ctx.parent).params)
    except typer.Exit:  # -- --help printed encode's help
        raise
    except Exception as exc:
        if not hasattr(exc, "format_message"):  # the parser's usage errors have it
            raise
        raise fail(f"encode options after --: {exc.format_message()}", ExitCode.USAGE) from None


def check_task_args(args: list[str], command: str) -> None:
    """Refuse encode options the engine sets itself, and storage options that look like secrets
    (they would travel with every task: credentials come from the store's own chain)."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in RESERVED_ENCODE_OPTIONS:
            raise ConfigError(f"encode option {name} cannot follow --: `mmenc {command}` sets --out, --model and the "
                              "task index/count itself; --overwrite would let tasks delete each other's shards")
    secrets = secret_storage_options(args)
    if secrets:
        raise ConfigError(f"--storage-option {', '.join(secrets)} would send a secret with every task: give the "
                          "tasks their credentials through the store's own chain (environment, profile, role)")


def task_model(model: str | None) -> str:
    """`--model` as every task must see it: a local folder made absolute; the bundled demo model
    (with a warning) when none is given."""
    if model is None:
        model = default_model()
        echo_err(f"mmenc: warning: no --model: the job uses the bundled DEMO model {model}")
    if Path(model).expanduser().exists():
        return os.path.abspath(Path(model).expanduser())
    from ..encoders.libraries import canonical_model  # open_clip:./folder, timm:~/folder: absolute

    return canonical_model(model)


def absolute_inputs(manifests: list[str]) -> tuple[str, ...]:
    """Inputs as every task must see them: local paths (and patterns) absolute, URLs as given."""
    from ..readers.files import is_url

    return tuple(m if is_url(m) else os.path.abspath(m) for m in manifests)
