"""Annotated Typer options shared by the commands (one definition each)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

OutArg = Annotated[Path, typer.Argument(help="Output folder of an mmenc run.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (for scripts).")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Hugging Face model id or local directory. Default: the bundled DEMO model "
    "(random weights, meaningless embeddings; for trying mmenc offline).")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Output folder (created if missing).")]
DeviceOpt = Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps; a comma list (cuda:0,cuda:1) "
                                             "runs one worker process per device.")]
TaskIndexOpt = Annotated[Optional[int], typer.Option(
    help="This task's index (default: SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN, else 0).")]
TaskCountOpt = Annotated[Optional[int], typer.Option(
    help="Number of tasks the input is split into (default: SLURM_ARRAY_TASK_COUNT, else 1).")]
