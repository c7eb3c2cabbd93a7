"""`mmenc slurm`: write, and optionally submit, an sbatch array script that runs `mmenc encode`."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from ..clock import timestamp
from ..errors import ConfigError, ExitCode, OutputError, SubmitError
from ..output.layout import shown
from ..slurm import SlurmOptions
from .encode_args import EncodeArgsCommand, absolute_inputs, parse_encode_args, task_model
from .encode_args import encode_args as encode_args_of
from .exits import fail, fatal_errors
from .options import ModelOpt, OutOpt, secret_storage_options
from .render import echo_err, plural

@dataclass(frozen=True)
class SlurmParams:
    """The `slurm` command's parameters, typed, by name (what `_options` reads; a renamed option
    fails here, at import, not as a KeyError at run time)."""

    manifests: list[str]
    out: str
    tasks: int
    model: str | None
    partition: str | None
    time_limit: str | None
    gpus_per_task: int | None
    cpus_per_task: int | None
    mem: str | None
    signal_before: int
    requeue: bool
    logs: Path | None
    job_name: str | None
    script: Path | None
    do_submit: bool
    sbatch_arg: list[str] | None
    python: str | None


def _job_name(out: str) -> str:
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in out.rstrip("/").rsplit("/", 1)[-1])[:40]
    return f"mmenc-{name}" if name else "mmenc"


def slurm(
    ctx: typer.Context,
    manifests: Annotated[List[str], typer.Argument(help="Inputs, as for encode (local paths made absolute; "
                                                   "patterns and URLs kept as they are, for each task to expand).",
                                                    show_default=False)],
    out: OutOpt,
    tasks: Annotated[int, typer.Option("--tasks", min=1, help="Array tasks: the input is split into N slices "
                                       "(--array=0-(N-1)).", show_default=False)],
    model: ModelOpt = None,
    partition: Annotated[Optional[str], typer.Option(help="Slurm partition (default: the cluster's).")] = SlurmOptions.partition,
    time_limit: Annotated[Optional[str], typer.Option("--time", help="Time limit per task, e.g. 04:00:00 or "
                                                      "1-00:00:00 (default: the partition's).")] = SlurmOptions.time,
    gpus_per_task: Annotated[int, typer.Option(min=0, help="GPUs per task (0 on CPU clusters; sites that want "
                                               "--gres: 0 here and --sbatch-arg=--gres=gpu:1).")] = SlurmOptions.gpus_per_task,
    cpus_per_task: Annotated[int, typer.Option(min=1, help="CPUs per task (decode workers use them).")] = SlurmOptions.cpus_per_task,
    mem: Annotated[Optional[str], typer.Option(help="Memory per task, e.g. 32G (default: the cluster's).")] = SlurmOptions.mem,
    signal_before: Annotated[int, typer.Option(min=0, help="Seconds before the time limit Slurm sends SIGTERM to "
                                               "mmenc (#SBATCH --signal=B:TERM@N): it commits whole shards and exits "
                                               "143, resumable. 0: none.")] = SlurmOptions.signal_before,
    requeue: Annotated[bool, typer.Option("--requeue/--no-requeue", help="Let Slurm requeue preempted or "
                                          "node-failed tasks (safe: every run resumes).")] = SlurmOptions.requeue,
    logs: Annotated[Optional[Path], typer.Option(help="Folder of the task logs, DIR/%A_%a.out "
                                                 f"[default: {shown('logs')}].", show_default=False)] = None,
    job_name: Annotated[Optional[str], typer.Option(help="Job name [default: mmenc-<OUT name>].",
                                                    show_default=False)] = None,
    script: Annotated[Optional[Path], typer.Option(help="Where to write the script; - prints it "
                                                   f"[default: {shown('slurm', 'encode-<time>.sbatch')}].",
                                                   show_default=False)] = None,
    do_submit: Annotated[bool, typer.Option("--submit", help="Submit with sbatch and print the job id "
                                            "(only the id, on stdout).")] = False,
    sbatch_arg: Annotated[Optional[List[str]], typer.Option(help="Extra #SBATCH option as --opt=value "
                                                            "(repeatable), e.g. --sbatch-arg=--account=abc.")] = None,
    python: Annotated[Optional[str], typer.Option(help="Python that runs mmenc in the job [default: this one, "
                                                  "so the job uses the same environment].",
                                                  show_default=False)] = None,
) -> None:
    """Write an sbatch array script that runs `mmenc encode` as N tasks over one output; --submit submits it.

    Encode options go after `--`, e.g.: mmenc slurm m.jsonl --out OUT --model M --tasks 4 -- --batch-size 64.
    Without --submit the script's path is printed on stdout. Re-run unfinished tasks (`mmenc status OUT`
    lists them) with `sbatch --array=1,3 SCRIPT`: every task resumes where it stopped.
    Exit codes: 0 ok, 2 usage error, 3 output not writable or sbatch missing or failing.
    """
    o = SlurmParams(**{k: v for k, v in locals().items() if k != "ctx"})  # the parameters, and nothing else yet
    from ..slurm import build_sbatch_script, submit

    with fatal_errors():
        opts = _options(ctx, o)
        text = build_sbatch_script(opts)
        if str(script) == "-":
            if do_submit:
                raise ConfigError("--script - prints the script; it cannot also be submitted")
            typer.echo(text, nl=False)
            return
        path = _write(opts, script, text)
    if not do_submit:
        typer.echo(str(path))
        echo_err(f"mmenc: wrote {path}; submit it with: sbatch {shlex.quote(str(path))}")
        return
    try:
        job = submit(path)
    except SubmitError as exc:
        raise fail(str(exc), exc.exit_code) from None
    typer.echo(job)
    echo_err(f"mmenc: submitted {path} as job {job}, {plural(tasks, 'task')}; logs in {opts.logs}; "
             f"follow with: mmenc status {shlex.quote(opts.out)}")


def _options(ctx: typer.Context, o: SlurmParams) -> Any:
    """The `SlurmOptions` of the command's parameters `o`, paths made absolute, the encode
    options after `--` checked."""
    from ..readers.files import check_input, is_url
    from ..slurm import default_logs_dir

    model = task_model(o.model)
    for m in o.manifests:
        check_input(m)
    out_abs = o.out if is_url(o.out) else os.path.abspath(os.path.expanduser(o.out))
    logs = o.logs
    logs_dir = Path(os.path.abspath(logs.expanduser())) if logs else default_logs_dir(out_abs)
    encode_args = encode_args_of(ctx)
    opts = SlurmOptions(
        manifests=absolute_inputs(o.manifests), out=out_abs, model=model,
        tasks=o.tasks,
        python=o.python or sys.executable, logs=str(logs_dir), job_name=o.job_name or _job_name(out_abs),
        partition=o.partition, time=o.time_limit, gpus_per_task=o.gpus_per_task,
        cpus_per_task=o.cpus_per_task, mem=o.mem, signal_before=o.signal_before, requeue=o.requeue,
        sbatch_args=tuple(o.sbatch_arg or ()), encode_args=tuple(encode_args),
        generated=timestamp())
    parse_encode_args(ctx, [*opts.manifests, "--out", opts.out, "--model", opts.model,
                             "--task-count", str(opts.tasks), "--task-index", "0", *encode_args])
    secrets = secret_storage_options(encode_args)
    if secrets:
        raise fail(f"--storage-option {', '.join(secrets)} would write a secret into the script: give the "
                   "tasks their credentials through the store's own chain (environment, profile, role)",
                   ExitCode.USAGE)
    return opts


def _write(opts: Any, script: Path | None, text: str) -> Path:
    """Write the script (and make the log folder, which Slurm does not create: no log at all otherwise)."""
    from ..slurm import default_script_path, write_script

    try:
        path = Path(os.path.abspath(script.expanduser())) if script else default_script_path(opts.out)
        Path(opts.logs).mkdir(parents=True, exist_ok=True)
        write_script(path, text)
    except OSError as exc:
        raise OutputError(f"cannot write the script or the log folder: {exc}") from None
    return path


def register(app: typer.Typer) -> None:
    """Add `slurm` to the main app (its own command class keeps the options after `--`)."""
    app.command("slurm", cls=EncodeArgsCommand, no_args_is_help=True)(slurm)
