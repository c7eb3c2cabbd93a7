"""Annotated Typer options shared by the commands (one definition each)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

OutArg = Annotated[str, typer.Argument(help="Output of an mmenc run: a folder, or an object-store URL (s3://, gs://, "
                                            "az://).", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (for scripts).")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="A Hugging Face model id (openai/clip-vit-base-patch32), a local model folder, "
    "open_clip:ARCH/PRETRAINED or open_clip:hf-hub:ID (OpenCLIP), timm:NAME or timm:hf-hub:ID (timm). Default: "
    "the bundled DEMO model (random weights, meaningless embeddings; for trying mmenc offline).")]
OutOpt = Annotated[str, typer.Option("--out", "-o", help="Output folder (created if missing), or an object-store "
                                                        "URL: s3://bucket/prefix, gs://..., az://... (its fsspec "
                                                        "package installed; credentials from the store's own chain).")]
StorageOpt = Annotated[Optional[List[str]], typer.Option(
    "--storage-option", help="KEY=VALUE passed to an object store's fsspec filesystem (repeatable), e.g. "
    "--storage-option endpoint_url=http://localhost:9000. Never recorded in the output's metadata.")]
SingleWriterOpt = Annotated[bool, typer.Option(
    "--single-writer", help="The scheduler runs each task once at a time: allow an object store that cannot "
    "refuse to overwrite (no exclusive create). Two runners of one task there could both commit.")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps; a comma list (cuda:0,cuda:1) "
                                             "runs one worker process per device.")]
TaskIndexOpt = Annotated[Optional[int], typer.Option(
    help="This task's index (default: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN, else a Kubernetes "
    "Indexed Job's JOB_COMPLETION_INDEX, else 0).")]
TaskCountOpt = Annotated[Optional[int], typer.Option(
    help="Number of tasks the input is split into (default: SLURM_ARRAY_TASK_COUNT, else MMENC_TASK_COUNT, "
    "else 1).")]


def opened(out: str, storage_options: list[str] | None) -> Any:
    """The output `out` opened with `--storage-option`s (`output.open_output`), exit 3 or 2 on a fault."""
    from ..output import open_output
    from .exits import fatal_errors

    with fatal_errors():
        return open_output(out, parse_storage_options(storage_options))


def parse_storage_options(given: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`--storage-option KEY=VALUE`s as (key, value) pairs (ConfigError for one without `=`)."""
    from ..errors import ConfigError

    pairs = []
    for item in given or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option {item!r} is not KEY=VALUE")
        pairs.append((key.strip(), value))
    return tuple(pairs)


_SECRET_WORDS = ("secret", "token", "password", "credential", "sas", "account_key", "connection_string")


def secret_storage_options(args: list[str]) -> list[str]:
    """The keys of `--storage-option`s in an encode command line that may hold a secret (what a
    script `mmenc slurm` writes must not carry: secrets come from the store's credential chain)."""
    found = []
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--storage-option=") else (
            args[i + 1] if arg == "--storage-option" and i + 1 < len(args) else None)
        key = (value or "").partition("=")[0].strip().lower()
        if key and (key == "key" or any(word in key for word in _SECRET_WORDS)):
            found.append(key)
    return found
