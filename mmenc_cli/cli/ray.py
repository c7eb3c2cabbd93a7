"""`mmenc ray`: run `mmenc encode` as N tasks on a Ray cluster, with one progress display, one
summary and one exit code (`engines/`). Ray is imported only by this command (`mmenc[ray]`)."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, replace
from typing import Annotated, Any, List, Optional

import typer

from ..errors import ExitCode
from .encode import EncodeOptions, Signals, build_config
from .encode_args import EncodeArgsCommand, absolute_inputs, check_task_args, encode_args, parse_encode_args, task_model
from .exits import fail, fatal_errors
from .options import ModelOpt, OutOpt
from .render import Progress, echo_err, job_lines, setup_logging


@dataclass(frozen=True)
class RayParams:
    """The `ray` command's parameters, typed, by name."""

    manifests: list[str]
    out: str
    tasks: int
    model: str | None
    address: str | None
    gpus_per_task: float | None
    cpus_per_task: int
    max_retries: int
    connect_timeout: float


@dataclass(frozen=True)
class Shown:
    """How the driver shows the job: the display options given after `--`, as encode takes them."""

    progress: str
    log_every: float
    json_out: bool
    verbose: bool


def ray(
    ctx: typer.Context,
    manifests: Annotated[List[str], typer.Argument(help="Inputs, as for encode (local paths made absolute: every "
                                                   "node must see them there; URLs kept).", show_default=False)],
    out: OutOpt,
    tasks: Annotated[int, typer.Option("--tasks", min=1, help="Tasks: the input is split into N slices, one Ray "
                                       "task each.", show_default=False)],
    model: ModelOpt = None,
    address: Annotated[Optional[str], typer.Option(help="The Ray cluster: HOST:PORT or ray://HOST:PORT; local starts "
                                                   "a new one on this machine [default: RAY_ADDRESS, else a cluster "
                                                   "`ray start` began here, else a new local one]",
                                                   show_default=False)] = None,
    gpus_per_task: Annotated[Optional[float], typer.Option(min=0, help="GPUs per task [default: 1 when the encode "
                                                           "options ask for --device cuda (one per device listed), "
                                                           "else 0]", show_default=False)] = None,
    cpus_per_task: Annotated[int, typer.Option(min=1, help="CPUs per task (the encode process and its decode "
                                               "workers: --workers defaults to this less one).")] = 1,
    max_retries: Annotated[int, typer.Option(min=0, help="Retries of a task whose worker or node dies, or that "
                                             "was interrupted or met a live runner of its slice (each resumes).")] = 3,
    connect_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to reach a cluster given by address "
                                                   "(--address or RAY_ADDRESS) before giving up (exit 3).")] = 30.0,
) -> None:
    """Run `mmenc encode` as N tasks on a Ray cluster into one OUT; every task resumes where it stopped.

    Encode options go after `--`, e.g.: mmenc ray data/*.tar --out s3://b/emb --tasks 64 -- --batch-size 128.
    --max-errors and --max-error-rate apply to the whole job; --progress, --json and --verbose to the
    driver's display. Stopping the driver (Ctrl-C, SIGTERM) cancels its tasks; running it again resumes.
    Exit codes: 0 done; 2 usage error; 3 setup error (no Ray, the cluster not reached within
    --connect-timeout, the model, the inputs or OUT not usable on the workers, an output fault); 4 past the error threshold or work left; 130/143 stopped; otherwise
    the code of the first task that failed after its retries (137: its worker died every time).
    """
    p = RayParams(**{k: v for k, v in locals().items() if k != "ctx"})  # the parameters, and nothing else yet
    setup_logging()
    with fatal_errors():
        spec, shown = _job(ctx, p)
    run_job = _driver()
    setup_logging(shown.verbose)
    bar, stop = Progress(shown.progress, shown.log_every), threading.Event()
    try:
        with Signals(stop) as sigs:
            with fatal_errors():
                try:
                    job = run_job(spec, bar, stop, lambda: sigs.signum)
                finally:
                    bar.close()
            _finish(job, shown)
    except KeyboardInterrupt:  # a second Ctrl-C: the tasks' workers were killed
        raise typer.Exit(128 + signal.SIGINT) from None


def _driver() -> Any:
    """The driver's `run_job`; Ray itself missing is a setup error naming the extra."""
    try:
        from ..engines.ray_driver import run_job
    except ImportError as exc:
        raise fail(f"mmenc ray needs Ray ({exc}): pip install 'mmenc[ray]'", ExitCode.SETUP) from None
    return run_job


def _job(ctx: typer.Context, p: RayParams) -> tuple[Any, Shown]:
    """The job's spec (encode options parsed and checked here; inputs and model on a worker later)."""
    from ..engines.job import JobSpec
    from ..readers.files import is_url

    args = encode_args(ctx)
    check_task_args(args, "ray")
    out = p.out if is_url(p.out) else str(absolute_inputs([p.out])[0])
    params = parse_encode_args(ctx, [*absolute_inputs(p.manifests), "--out", out, "--model", task_model(p.model),
                                     "--task-count", str(p.tasks), "--task-index", "0", *args])
    options = EncodeOptions(**params)
    if options.workers is None:  # a task's decode workers use its own CPUs, not the node's
        options = replace(options, workers=p.cpus_per_task - 1)
    cfg = build_config(options, check_inputs=False)
    gpus = p.gpus_per_task
    if gpus is None:
        gpus = float(sum(1 for d in cfg.model.devices if d.startswith("cuda")))
    spec = JobSpec(cfg=cfg, tasks=p.tasks, cpus_per_task=p.cpus_per_task, gpus_per_task=gpus,
                   max_retries=p.max_retries, address=p.address, connect_timeout=p.connect_timeout)
    return spec, Shown(params["progress"], params["log_every"], params["json_out"], params["verbose"])


def _finish(job: Any, shown: Shown) -> None:
    """Print the job's summary (and the --json result) and exit with the job's code."""
    echo_err("\n".join(job_lines(job, shown.verbose)))
    if shown.json_out:
        from ..error_rows import json_line

        typer.echo(json_line(job.to_dict()))
    if job.code:
        raise typer.Exit(int(job.code))


def register(app: typer.Typer) -> None:
    """Add `ray` to the main app (its own command class keeps the options after `--`)."""
    app.command("ray", cls=EncodeArgsCommand, no_args_is_help=True)(ray)
