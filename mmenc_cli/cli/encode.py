"""`mmenc encode`: options -> one `RunConfig` -> `run_encode` -> a summary and an exit code."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from ..config import (DEFAULT_DECODE, DEFAULT_FRAMES, MAX_FPS_FRAMES, BatchConfig, ManifestConfig, MediaConfig,
                      ModelConfig, RunConfig, WriterConfig)
from ..errors import ConfigError, ExitCode
from ..run.model_identity import DEMO_MODEL
from ..stopping import request_stop
from .exits import fail, fatal_errors
from .options import DeviceOpt, ModelOpt, OutOpt, SingleWriterOpt, StorageOpt, TaskCountOpt, TaskIndexOpt
from .options import parse_storage_options
from .render import Progress, echo_err, setup_logging, summary_lines

log = logging.getLogger("mmenc")


def default_model() -> str:
    """The model when none is given: $MMENC_DEFAULT_MODEL, else the bundled demo model."""
    env = os.environ.get("MMENC_DEFAULT_MODEL")
    if env:
        return env
    if (DEMO_MODEL / "config.json").is_file():
        return str(DEMO_MODEL)
    raise fail(f"no --model given and the bundled demo model ({DEMO_MODEL}) is missing from this install",
               ExitCode.USAGE)


def task_from_env(index: int | None, count: int | None) -> tuple[int, int]:
    """Task index and count: the options; else Slurm's array variables; else a Kubernetes Indexed
    Job's `JOB_COMPLETION_INDEX` with the count from `MMENC_TASK_COUNT`; else (0, 1). An index from
    the environment without a count, or `MMENC_TASK_COUNT` without any index, is a usage error: every
    pod would encode the same slice, or all of the input."""
    env = os.environ
    counted_by = None if count is not None else next(
        (name for name in ("SLURM_ARRAY_TASK_COUNT", "MMENC_TASK_COUNT") if env.get(name)), None)
    if counted_by:
        count = _env_int(counted_by)
    if index is None and env.get("SLURM_ARRAY_TASK_ID"):
        index = _env_int("SLURM_ARRAY_TASK_ID") - (_env_int("SLURM_ARRAY_TASK_MIN") if env.get("SLURM_ARRAY_TASK_MIN")
                                                   else 0)
    elif index is None and env.get("JOB_COMPLETION_INDEX"):
        index = _env_int("JOB_COMPLETION_INDEX")
        if count is None:
            raise ConfigError(f"JOB_COMPLETION_INDEX={index} (a Kubernetes Indexed Job) but no task count: set "
                              "MMENC_TASK_COUNT to the Job's completions, or pass --task-count")
    elif index is None and counted_by == "MMENC_TASK_COUNT":
        raise ConfigError(f"MMENC_TASK_COUNT={count} but no task index: run it as a Kubernetes Indexed Job "
                          "(JOB_COMPLETION_INDEX) or pass --task-index")
    return (0 if index is None else index), (1 if count is None else count)


def _env_int(name: str) -> int:
    """A whole number from the environment variable `name` (a usage error otherwise)."""
    value = os.environ[name].strip()
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number") from None


class Signals:
    """Turn SIGINT/SIGTERM into a stop request; the run commits whole shards and exits 130/143. A
    second Ctrl-C stops at once (the task is still recorded as interrupted)."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "Signals":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum
        log.warning("received %s: finishing the current batch, committing whole shards, then exiting",
                    signal.Signals(signum).name)
        request_stop(self.stop, signum)  # inside a model load or a tokenizing stretch: interrupts it at once

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():  # once stopping, more signals only cut the exit short: ignored
            signal.signal(sig, signal.SIG_IGN if self.signum is not None else old)


@dataclass(frozen=True)
class EncodeOptions:
    """The `encode` command's parameters, typed, by name (`tests/cli/test_options.py` holds the two
    together): what `build_config` reads. No defaults here: the command's come from the config."""

    manifests: list[str]
    out: Path
    model: str
    revision: str | None
    modality: str | None
    id_key: str | None
    image_key: str | None
    text_key: str | None
    audio_key: str | None
    video_key: str | None
    keep: list[str] | None
    limit: int | None
    csv_multiline: bool
    text_prefix: str
    max_length: int | None
    pooling: str
    normalize: bool | None
    batch_size: int | None
    max_batch_tokens: int | None
    device: str
    dtype: str
    compile: bool
    cpu_forward: str
    trust_remote_code: bool
    allow_pickle_weights: bool
    workers: int | None
    max_inflight_bytes: int
    format: str
    out_dtype: str | None
    shard_size: int
    max_image_pixels: int
    max_file_bytes: int
    max_audio_bytes: int
    max_video_bytes: int
    max_audio_seconds: float | None
    max_video_seconds: float
    frames: int | None
    fps: float | None
    fetch_timeout: float
    fetch_retries: int
    decode_timeout: float
    decode: str | None
    max_row_bytes: int
    max_errors: int | None
    max_error_rate: float | None
    fail_fast: bool
    overwrite: bool
    wait_lock: bool
    storage_options: list[str] | None
    single_writer: bool
    task_index: int | None
    task_count: int | None
    progress: str
    log_every: float
    json_out: bool
    verbose: bool


def build_config(o: EncodeOptions, check_inputs: bool = True) -> RunConfig:
    """The `RunConfig` of the encode options `o` (the task from the environment where not given);
    `check_inputs=False` where the inputs are checked elsewhere (`mmenc ray`: on a worker)."""
    from ..readers.files import check_input

    for m in o.manifests if check_inputs else ():
        check_input(m)
    if o.progress not in ("auto", "bar", "log", "none"):
        raise ConfigError("--progress must be auto, bar, log or none")
    mods = tuple(m.strip() for m in o.modality.split(",") if m.strip()) if o.modality else None
    index, count = task_from_env(o.task_index, o.task_count)
    return RunConfig(
        manifests=tuple(str(m) for m in o.manifests),
        model=ModelConfig(model=o.model, revision=o.revision, pooling=o.pooling, device=o.device, dtype=o.dtype,
                          normalize=o.normalize, text_prefix=o.text_prefix, max_length=o.max_length,
                          trust_remote_code=o.trust_remote_code, allow_pickle_weights=o.allow_pickle_weights,
                          compile=o.compile, cpu_forward=o.cpu_forward),
        writer=WriterConfig(out=str(o.out), format=o.format, out_dtype=o.out_dtype, shard_size=o.shard_size,
                            storage_options=parse_storage_options(o.storage_options),
                            single_writer=o.single_writer),
        manifest=ManifestConfig(id_key=o.id_key, image_key=o.image_key, text_key=o.text_key, audio_key=o.audio_key,
                                video_key=o.video_key, keep=keep_fields(o.keep), limit=o.limit,
                                csv_multiline=o.csv_multiline, max_row_bytes=o.max_row_bytes),
        media=MediaConfig(max_image_pixels=o.max_image_pixels, max_file_bytes=o.max_file_bytes,
                          max_audio_bytes=o.max_audio_bytes, max_video_bytes=o.max_video_bytes,
                          max_audio_seconds=o.max_audio_seconds, max_video_seconds=o.max_video_seconds,
                          frames=o.frames, fps=o.fps, fetch_timeout=o.fetch_timeout, fetch_retries=o.fetch_retries,
                          decode_timeout=o.decode_timeout, decode=o.decode),
        batch=BatchConfig(batch_size=o.batch_size, max_batch_tokens=o.max_batch_tokens, workers=o.workers,
                          max_inflight_bytes=o.max_inflight_bytes),
        modalities=mods, task_index=index, task_count=count, max_errors=o.max_errors,
        max_error_rate=o.max_error_rate, fail_fast=o.fail_fast, overwrite=o.overwrite, wait_lock=o.wait_lock)


def finish(result: Any, signum: int | None, json_out: bool, verbose: bool) -> None:
    """Print the summary (and the --json result) and exit with the run's code."""
    code = ExitCode.OK
    if signum is not None:
        code = 128 + signum
    elif not result.counters.balanced:
        code = ExitCode.INTERNAL  # an item neither encoded, failed nor left for a re-run: our bug
    elif result.state == "stopped" or result.threshold_exceeded:
        code = ExitCode.THRESHOLD
    echo_err("\n".join(summary_lines(result, verbose)))
    if json_out:
        from ..error_rows import json_line

        typer.echo(json_line({**result.to_dict(), "exit_code": int(code)}))
    if code:
        raise typer.Exit(int(code))


def keep_fields(given: list[str] | None) -> tuple[str, ...]:
    """`--keep a,b --keep c` as the fields a, b and c (blank parts dropped)."""
    return tuple(part.strip() for value in given or () for part in value.split(",") if part.strip())


def encode(
    manifests: Annotated[List[str], typer.Argument(help="Manifests (JSONL, CSV, Parquet, Arrow), WebDataset tars, "
                                                        "folders; globs and brace ranges; fsspec URLs.",
                                                   show_default=False)],
    out: OutOpt,
    model: ModelOpt = None,
    revision: Annotated[Optional[str], typer.Option(help="Model revision (hub branch, tag or commit).")] = ModelConfig.revision,
    modality: Annotated[Optional[str], typer.Option(help="A comma list of image, text, audio, video (default: every one the model has a tower for; video only when asked).")] = None,
    id_key: Annotated[Optional[str], typer.Option(help="Key of the id [default: per input: id; a tar sample's key; a folder's relative path].", show_default=False)] = ManifestConfig.id_key,
    image_key: Annotated[Optional[str], typer.Option(help="Key of the image [default: per input: image; a tar's jpg, jpeg, png or webp].", show_default=False)] = ManifestConfig.image_key,
    text_key: Annotated[Optional[str], typer.Option(help="Key of the text [default: per input: text; a tar's txt; a folder's .txt].", show_default=False)] = ManifestConfig.text_key,
    audio_key: Annotated[Optional[str], typer.Option(help="Key of the audio clip [default: per input: audio; a tar's flac, wav, mp3, opus, ogg or m4a].", show_default=False)] = ManifestConfig.audio_key,
    video_key: Annotated[Optional[str], typer.Option(help="Key of the video clip [default: per input: video; a tar's mp4, webm, mkv or mov].", show_default=False)] = ManifestConfig.video_key,
    keep: Annotated[Optional[List[str]], typer.Option(help="Copy these manifest fields onto every output row (a comma list, or repeated).")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Encode only the first N rows (of this task's slice).")] = ManifestConfig.limit,
    csv_multiline: Annotated[bool, typer.Option("--csv-multiline", help="CSV quoted fields span lines: split tasks by parsing from the top (exact, slower).")] = ManifestConfig.csv_multiline,
    text_prefix: Annotated[str, typer.Option(help='Prepended to every text, e.g. "query: ".')] = ModelConfig.text_prefix,
    max_length: Annotated[Optional[int], typer.Option(help="Cap on text tokens (default: the model's limit).")] = ModelConfig.max_length,
    pooling: Annotated[str, typer.Option(help="auto, cls, mean, tokens (token-level models) or frames (per-frame embeddings of video clips).")] = ModelConfig.pooling,
    normalize: Annotated[Optional[bool], typer.Option("--normalize/--no-normalize", help="L2-normalize vectors (default: the model's convention; recorded).")] = ModelConfig.normalize,
    batch_size: Annotated[Optional[int], typer.Option(help="Items per micro-batch [default: 32 on the CPU; on CUDA the largest that a short probe at load finds fits and keeps the model's throughput].")] = BatchConfig.batch_size,
    max_batch_tokens: Annotated[Optional[int], typer.Option(help="Token budget per batch (token-level models).")] = BatchConfig.max_batch_tokens,
    device: DeviceOpt = ModelConfig.device,
    dtype: Annotated[str, typer.Option(help="auto, float32, float16, bfloat16 (auto: bf16/fp16 on CUDA, fp32 on CPU).")] = ModelConfig.dtype,
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the model (falls back to eager if unsupported).")] = ModelConfig.compile,
    cpu_forward: Annotated[str, typer.Option(help="CPU forward: auto (oneDNN's or PyTorch's linears, whichever the run's own batches find faster; two batch streams), plain (PyTorch's own forward, one stream), onednn (oneDNN's linears pinned).")] = ModelConfig.cpu_forward,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="Allow model code from the hub.")] = ModelConfig.trust_remote_code,
    allow_pickle_weights: Annotated[bool, typer.Option("--allow-pickle-weights", help="Allow .bin (pickle) weights; default safetensors only.")] = ModelConfig.allow_pickle_weights,
    workers: Annotated[Optional[int], typer.Option(help="Decode worker processes in all (default: the CPUs this "
                                                        "process may use, less one per device; split between "
                                                        "devices; 0 = in-process).")] = BatchConfig.workers,
    max_inflight_bytes: Annotated[int, typer.Option(help="Undecoded inline bytes (tar members, Parquet and Arrow "
                                                         "image bytes) waiting for or in the decode workers at "
                                                         "once; a larger item goes alone (paths and URLs count "
                                                         "0).")] = BatchConfig.max_inflight_bytes,
    format: Annotated[str, typer.Option("--format", help="parquet or safetensors.")] = WriterConfig.format,
    out_dtype: Annotated[Optional[str], typer.Option(help="float32 (default for vectors), float16, bfloat16 (safetensors).")] = WriterConfig.out_dtype,
    shard_size: Annotated[int, typer.Option(help="Rows per shard.")] = WriterConfig.shard_size,
    max_image_pixels: Annotated[int, typer.Option(help="Larger images fail with 413.")] = MediaConfig.max_image_pixels,
    max_file_bytes: Annotated[int, typer.Option(help="Larger files fail with 413.")] = MediaConfig.max_file_bytes,
    max_audio_bytes: Annotated[int, typer.Option(help="Larger audio files fail with 413.")] = MediaConfig.max_audio_bytes,
    max_video_bytes: Annotated[int, typer.Option(help="Larger video files fail with 413 (a local one is read only "
                                                      "where its frames are).")] = MediaConfig.max_video_bytes,
    max_audio_seconds: Annotated[Optional[float], typer.Option(help="Longer audio is cut to its first N seconds "
                                                               "(counted as truncated), never more than the "
                                                               "model's window [default: the window, CLAP 10 s]", show_default=False)] = MediaConfig.max_audio_seconds,
    max_video_seconds: Annotated[float, typer.Option(help="Frames are sampled from the first N seconds of a video "
                                                          "(longer ones counted as truncated).")] = MediaConfig.max_video_seconds,
    frames: Annotated[Optional[int], typer.Option(help="Frames sampled uniformly from each video clip (with --fps: "
                                                  f"at most this many) [default: {DEFAULT_FRAMES}; with --fps "
                                                  f"{MAX_FPS_FRAMES}]", show_default=False)] = MediaConfig.frames,
    fps: Annotated[Optional[float], typer.Option(help="Sample video frames at this rate instead (at most --frames "
                                                 "of them, spread uniformly when more).", show_default=False)] = MediaConfig.fps,
    fetch_timeout: Annotated[float, typer.Option(help="Seconds per HTTP attempt.")] = MediaConfig.fetch_timeout,
    fetch_retries: Annotated[int, typer.Option(help="HTTP retries with back-off.")] = MediaConfig.fetch_retries,
    decode_timeout: Annotated[float, typer.Option(help="Seconds to read, decode and preprocess one image "
                                                       "(after its fetch); a worker past it is replaced.")] = MediaConfig.decode_timeout,
    decode: Annotated[Optional[str], typer.Option(help="fast: JPEGs at least 4x the model's input decode at a "
                                                  "reduced scale, resizes run on torch's SIMD kernels (several "
                                                  "times faster, close pixels); exact: the processor's own "
                                                  "pixels; gpu: JPEGs decoded and resized on the device (nvJPEG, "
                                                  f"needs mmenc[gpu]) [default: {DEFAULT_DECODE}; a resumed output "
                                                  "keeps its mode]", show_default=False)] = MediaConfig.decode,
    max_row_bytes: Annotated[int, typer.Option(help="A manifest line or CSV record larger than this fails "
                                                    "with 413 without being loaded.")] = ManifestConfig.max_row_bytes,
    max_errors: Annotated[Optional[int], typer.Option(help="Exit 4 when more items fail.")] = RunConfig.max_errors,
    max_error_rate: Annotated[Optional[float], typer.Option(help="Exit 4 when a larger share fails (0..1).")] = RunConfig.max_error_rate,
    fail_fast: Annotated[bool, typer.Option("--fail-fast", help="Stop at the first failed item (exit 4).")] = RunConfig.fail_fast,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Delete the existing output and start over.")] = RunConfig.overwrite,
    wait_lock: Annotated[bool, typer.Option("--wait-lock", help="Wait for a running run of this task instead of exiting 75.")] = RunConfig.wait_lock,
    storage_options: StorageOpt = None,
    single_writer: SingleWriterOpt = WriterConfig.single_writer,
    task_index: TaskIndexOpt = None,
    task_count: TaskCountOpt = None,
    progress: Annotated[str, typer.Option(help="auto (bar on a terminal, log lines otherwise), bar, log, none.")] = "auto",
    log_every: Annotated[float, typer.Option(help="Seconds between progress log lines when not on a terminal.")] = 30.0,
    json_out: Annotated[bool, typer.Option("--json", help="Also print the run's result as one JSON object on stdout.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug log lines and seconds per stage.")] = False,
) -> None:
    """Encode manifests into embedding shards in OUT; failed items go to OUT/_mmenc/errors."""
    setup_logging(verbose)
    with fatal_errors():
        if model is None:
            model = default_model()  # the run says so when it loads it
        cfg = build_config(EncodeOptions(**locals()))  # the parameters, and nothing else yet
    stop = threading.Event()
    try:
        with Signals(stop) as sigs:  # until the end: a second Ctrl-C while the summary prints is still 130
            result = run(cfg, Progress(progress, log_every), stop)
            finish(result, sigs.signum, json_out, verbose)
    except KeyboardInterrupt:  # a second Ctrl-C: the task is recorded as interrupted already
        raise typer.Exit(128 + signal.SIGINT) from None


def run(cfg: Any, bar: Progress, stop: threading.Event) -> Any:
    """`run_encode` with a progress display, run-level errors turned into their exit codes."""
    from ..run.pipeline import run_encode  # torch and transformers load only when encoding

    with fatal_errors():
        try:
            return run_encode(cfg, progress=bar, stop=stop)
        finally:
            bar.close()
