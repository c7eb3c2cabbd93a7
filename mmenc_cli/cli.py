"""The `mmenc` command line: parse options, build a config, call the core, render, exit.

Exit codes (also in the README):
  0 the input is fully accounted for within the error threshold
  1 internal error                       2 usage error
  3 fatal setup error (model cannot load, output not writable, options conflict with the output)
  4 error threshold exceeded, or --fail-fast stopped the run
  75 the task's lock on OUT is held by another live run (EX_TEMPFAIL)
  130 interrupted by SIGINT, 143 by SIGTERM (resumable: re-run the same command)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Iterator, List, Optional

import typer

from .cli_options import DeviceOpt, JsonOpt, ModelOpt, OutArg, OutOpt, TaskCountOpt, TaskIndexOpt

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_SETUP, EXIT_THRESHOLD, EXIT_LOCKED = 0, 1, 2, 3, 4, 75

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Batch-encode images and texts into embeddings, offline, without losing a row.")
log = logging.getLogger("mmenc")


def _setup_logging(verbose: bool = False) -> None:
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s mmenc %(levelname)s: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False


def fail(message: str, code: int) -> typer.Exit:
    """Print one line on stderr and return the Exit to raise."""
    typer.echo(f"mmenc: error: {message}", err=True)
    return typer.Exit(code)


@contextlib.contextmanager
def fatal_errors() -> Iterator[None]:
    """Map run-level exceptions to one line and an exit code (traceback only with MMENC_DEBUG=1)."""
    from .config import ConfigError

    try:
        yield
    except typer.Exit:
        raise
    except Exception as exc:
        if os.environ.get("MMENC_DEBUG") == "1":
            raise
        name = type(exc).__name__
        if isinstance(exc, ConfigError):
            raise fail(str(exc), EXIT_USAGE) from None
        if name == "LockBusy":
            raise fail(str(exc), EXIT_LOCKED) from None
        if name in ("OutputError", "ModelLoadError", "ManifestError"):
            raise fail(str(exc), EXIT_SETUP) from None
        raise fail(f"internal error: {name}: {exc} (MMENC_DEBUG=1 shows the traceback)", EXIT_INTERNAL) from None


def default_model() -> str:
    """The bundled demo model: $MMENC_DEFAULT_MODEL, the repo's samples/demo-model, or ./samples/demo-model."""
    env = os.environ.get("MMENC_DEFAULT_MODEL")
    if env:
        return env
    for base in (Path(__file__).resolve().parent.parent, Path.cwd()):
        cand = base / "samples" / "demo-model"
        if (cand / "config.json").is_file():
            return str(cand)
    raise fail("no --model given and the bundled demo model (samples/demo-model) was not found", EXIT_USAGE)


def task_from_env(index: int | None, count: int | None) -> tuple[int, int]:
    """Task index and count from the options, else from Slurm's array variables, else (0, 1)."""
    env = os.environ
    if count is None:
        count = int(env["SLURM_ARRAY_TASK_COUNT"]) if env.get("SLURM_ARRAY_TASK_COUNT") else 1
    if index is None:
        if env.get("SLURM_ARRAY_TASK_ID"):
            index = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN") or 0)
        else:
            index = 0
    return index, count


class _Signals:
    """Turn SIGINT/SIGTERM into a stop request; the run commits whole shards and exits 130/143."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum
        log.warning("received %s: finishing the current batch, committing whole shards, then exiting",
                    signal.Signals(signum).name)
        self.stop.set()

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _Progress:
    """A rich progress line on a terminal; plain log lines every `every` seconds otherwise."""

    def __init__(self, mode: str, every: float) -> None:
        self.tty = sys.stderr.isatty() if mode == "auto" else mode == "bar"
        self.enabled = mode != "none"
        self.every = every
        self.t0 = time.monotonic()
        self.last = self.t0
        self.bar: Any = None

    def __call__(self, counters: Any) -> None:
        if not self.enabled:
            return
        done = sum(m.encoded for m in counters.modalities.values())
        failed = counters.failed_now
        rate = done / max(1e-9, time.monotonic() - self.t0)
        if self.tty:
            if self.bar is None:
                from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

                self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                    transient=True)
                self.bar.start()
                self.task = self.bar.add_task("")
            self.bar.update(self.task, description=f"rows {counters.rows}  encoded {done}  failed {failed}  {rate:.1f} items/s")
        elif time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            log.info("progress: rows %d, encoded %d, failed %d, %.1f items/s", counters.rows, done, failed, rate)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def render_summary(result: Any) -> None:
    """The end-of-run summary on stderr."""
    c = result.counters
    lines = [f"mmenc: {result.state} in {result.elapsed:.1f} s: {c.rows} rows read, output {result.out}"]
    for name, m in sorted(c.modalities.items()):
        failed = ", ".join(f"{k}: {v}" for k, v in sorted(m.failed.items())) or "0"
        lines.append(f"  {name:5s} requested {m.requested}, encoded {m.encoded} (+{m.encoded_before} earlier), "
                     f"failed {m.failed_total} [{failed}] (+{m.failed_before} earlier, not retried), "
                     f"skipped {m.skipped}, truncated {m.truncated}")
    secs = c.seconds
    done = sum(m.encoded for m in c.modalities.values())
    lines.append(f"  invalid lines {c.invalid} (+{c.invalid_before} earlier); rows without a requested modality {c.rows_skipped}")
    lines.append(f"  accounted: requested {c.requested} + invalid {c.invalid + c.invalid_before} = "
                 f"encoded {c.encoded} + failed {c.failed}: {'yes' if c.balanced else 'NO'}")
    lines.append(f"  throughput {done / max(result.elapsed, 1e-9):.1f} items/s; seconds read {secs['read']:.2f}, "
                 f"decode {secs['decode']:.2f} (worker time), tokenize {secs.get('tokenize', 0.0):.2f}, "
                 f"encode {secs['encode']:.2f}, write {secs['write']:.2f}")
    if not result.model_loaded:
        lines.append("  nothing new to encode: the model was not loaded")
    if result.threshold_exceeded:
        lines.append(f"  error threshold exceeded: {result.threshold_exceeded}")
    typer.echo("\n".join(lines), err=True)


@app.command()
def encode(
    manifests: Annotated[List[Path], typer.Argument(help="JSONL, Parquet or CSV manifests.", show_default=False)],
    out: OutOpt,
    model: ModelOpt = None,
    revision: Annotated[Optional[str], typer.Option(help="Model revision (hub branch, tag or commit).")] = None,
    modality: Annotated[Optional[str], typer.Option(help="image, text or image,text (default: all the model supports).")] = None,
    id_key: Annotated[str, typer.Option(help="Manifest key of the id.")] = "id",
    image_key: Annotated[str, typer.Option(help="Manifest key of the image.")] = "image",
    text_key: Annotated[str, typer.Option(help="Manifest key of the text.")] = "text",
    keep: Annotated[Optional[List[str]], typer.Option(help="Copy this manifest field onto every output row (repeatable).")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Encode only the first N rows (of this task's slice).")] = None,
    csv_multiline: Annotated[bool, typer.Option("--csv-multiline", help="CSV quoted fields span lines: split tasks by parsing from the top (exact, slower).")] = False,
    text_prefix: Annotated[str, typer.Option(help='Prepended to every text, e.g. "query: ".')] = "",
    max_length: Annotated[Optional[int], typer.Option(help="Cap on text tokens (default: the model's limit).")] = None,
    pooling: Annotated[str, typer.Option(help="auto, cls, mean or tokens.")] = "auto",
    normalize: Annotated[Optional[bool], typer.Option("--normalize/--no-normalize", help="L2-normalize vectors (default: the model's convention; recorded).")] = None,
    batch_size: Annotated[int, typer.Option(help="Items per micro-batch.")] = 32,
    max_batch_tokens: Annotated[Optional[int], typer.Option(help="Token budget per batch (token-level models).")] = None,
    device: DeviceOpt = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, float16, bfloat16 (auto: bf16/fp16 on CUDA, fp32 on CPU).")] = "auto",
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the model (falls back to eager if unsupported).")] = False,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub.")] = False,
    allow_pickle_weights: Annotated[bool, typer.Option("--allow-pickle-weights", help="Allow .bin (pickle) weights; default safetensors only.")] = False,
    workers: Annotated[Optional[int], typer.Option(help="Decode worker processes (default: CPUs - 1, at most 8; 0 = in-process).")] = None,
    format: Annotated[str, typer.Option("--format", help="parquet or safetensors.")] = "parquet",
    out_dtype: Annotated[Optional[str], typer.Option(help="float32 (default for vectors), float16, bfloat16 (safetensors).")] = None,
    shard_size: Annotated[int, typer.Option(help="Rows per shard.")] = 10_000,
    max_image_pixels: Annotated[int, typer.Option(help="Larger images fail with 413.")] = 89_478_485,
    max_file_bytes: Annotated[int, typer.Option(help="Larger files fail with 413.")] = 64 * 1024 * 1024,
    fetch_timeout: Annotated[float, typer.Option(help="Seconds per HTTP attempt.")] = 20.0,
    fetch_retries: Annotated[int, typer.Option(help="HTTP retries with back-off.")] = 3,
    max_errors: Annotated[Optional[int], typer.Option(help="Exit 4 when more items fail.")] = None,
    max_error_rate: Annotated[Optional[float], typer.Option(help="Exit 4 when a larger share fails (0..1).")] = None,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first failed item (exit 4).")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Delete the existing output and start over.")] = False,
    wait_lock: Annotated[bool, typer.Option("--wait-lock", help="Wait for a running run of this task instead of exiting 75.")] = False,
    task_index: TaskIndexOpt = None,
    task_count: TaskCountOpt = None,
    progress: Annotated[str, typer.Option(help="auto (bar on a terminal, log lines otherwise), bar, log, none.")] = "auto",
    log_every: Annotated[float, typer.Option(help="Seconds between progress log lines when not on a terminal.")] = 30.0,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Encode manifests into embedding shards in OUT; failed items go to OUT/_mmenc/errors."""
    _setup_logging(verbose)
    from .config import (BatchConfig, ConfigError, ManifestConfig, MediaConfig, ModelConfig, RunConfig,
                         WriterConfig)

    with fatal_errors():
        if model is None:
            model = default_model()
            log.warning("no --model: using the bundled DEMO model %s (random weights, meaningless embeddings)", model)
        mods = None
        if modality:
            mods = tuple(m.strip() for m in modality.split(",") if m.strip())
        index, count = task_from_env(task_index, task_count)
        for m in manifests:
            if not m.exists():
                raise ConfigError(f"manifest {m} does not exist")
        cfg = RunConfig(
            manifests=tuple(str(m) for m in manifests),
            model=ModelConfig(model=model, revision=revision, pooling=pooling, device=device, dtype=dtype,
                              normalize=normalize, text_prefix=text_prefix, max_length=max_length,
                              trust_remote_code=trust_remote_code, allow_pickle_weights=allow_pickle_weights,
                              compile=compile),
            writer=WriterConfig(out=str(out), format=format, out_dtype=out_dtype, shard_size=shard_size),
            manifest=ManifestConfig(id_key=id_key, image_key=image_key, text_key=text_key,
                                    keep=tuple(keep or ()), limit=limit, csv_multiline=csv_multiline),
            media=MediaConfig(max_image_pixels=max_image_pixels, max_file_bytes=max_file_bytes,
                              fetch_timeout=fetch_timeout, fetch_retries=fetch_retries),
            batch=BatchConfig(batch_size=batch_size, max_batch_tokens=max_batch_tokens, workers=workers),
            modalities=mods, task_index=index, task_count=count, max_errors=max_errors,
            max_error_rate=max_error_rate, fail_fast=fail_fast, overwrite=overwrite, wait_lock=wait_lock)
        if progress not in ("auto", "bar", "log", "none"):
            raise ConfigError("--progress must be auto, bar, log or none")
        from .pipeline import run_encode

        stop = threading.Event()
        bar = _Progress(progress, log_every)
        with _Signals(stop) as sigs:
            try:
                result = run_encode(cfg, progress=bar, stop=stop)
            finally:
                bar.close()
    render_summary(result)
    if sigs.signum is not None:
        raise typer.Exit(128 + sigs.signum)
    if result.state == "stopped" or result.threshold_exceeded:
        raise typer.Exit(EXIT_THRESHOLD)


@app.command()
def inspect(out: OutArg, json_out: JsonOpt = False) -> None:
    """Count embeddings per modality, show dim, dtype, model and shards; check every shard."""
    from .reader import inspect_output

    with fatal_errors():
        report = inspect_output(out)
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        from rich.console import Console
        from rich.table import Table

        con = Console(stderr=False)
        con.print(f"[bold]{out}[/]: {report.embeddings} embeddings "
                  + ", ".join(f"{k} {v}" for k, v in sorted(report.by_modality.items())))
        con.print(f"model {report.model} (revision {report.revision}), dim {report.dim}, "
                  f"dtype {report.dtype}, format {report.format}")
        table = Table("shard", "rows", "ok")
        for s in report.shards:
            table.add_row(s["name"], str(s["rows"]), "yes" if s["ok"] else f"NO: {s.get('error')}")
        con.print(table)
    for p in report.problems:
        typer.echo(f"mmenc: problem: {p}", err=True)
    if report.problems:
        raise typer.Exit(EXIT_SETUP)


def _register_subapps() -> None:
    from .cli_errors import errors_app
    from .cli_export import export_app
    from .cli_slurm import register as register_slurm

    app.add_typer(errors_app, name="errors")
    app.add_typer(export_app, name="export")
    register_slurm(app)


_register_subapps()


def main() -> None:
    """Console-script entry point."""
    app(prog_name="mmenc")
