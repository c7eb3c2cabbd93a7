"""`mmenc export vllm OUT DEST`: turn a `--pooling tokens` output into serving-engine inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from .exits import fatal_errors
from .options import JsonOpt, OutArg, StorageOpt, opened
from .render import echo_err, plural

export_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Export token embeddings for serving engines.")

DestArg = Annotated[Path, typer.Argument(help="Folder to write (empty, missing, or an earlier export).",
                                         show_default=False)]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export in DEST.")]


@export_app.command()
def vllm(out: OutArg, dest: DestArg, overwrite: OverwriteOpt = False, json_out: JsonOpt = False,
         storage_options: StorageOpt = None) -> None:
    """Per image, DEST/<id>.safetensors with `image_embeds` [tokens, hidden] and `image_grid_thw`
    [1, 3], plus DEST/manifest.jsonl: the precomputed Qwen2-VL image-embedding input of vLLM
    (multi_modal_data={"image": {"image_embeds": ..., "image_grid_thw": ...}}, enable_mm_embeds=True)."""
    from ..export import export_vllm

    with fatal_errors():
        result = export_vllm(opened(out, storage_options), dest, overwrite=overwrite)
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    echo_err(f"mmenc: exported {plural(result.items, 'image')} ({plural(result.tokens, 'token')}, {result.dtype}) "
             f"to {result.dest}; index {result.manifest}")
