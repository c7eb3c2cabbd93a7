"""Frozen, validated configuration for one run; saved with the run's metadata.

Options reach the core as one `RunConfig`, never as a splat of keyword arguments. Each part is
validated in `__post_init__` so a bad combination fails before anything is loaded.

This module is the one place of every option's default: the CLI's options read them from the
dataclasses (`BatchConfig.batch_size`). Each field is declared with `option(...)`, which says
whether it changes the vectors or the output's schema (`fingerprint=True`): those fields, and only
those, make the output's fingerprint (`fingerprint_fields`, `run/metadata.fingerprint`) that a
run resuming the output must match.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, is_dataclass, replace
from typing import Any, Callable, Iterator

from .cpus import usable_cpus
from .errors import ConfigError
from .records import MODALITIES

POOLINGS = ("auto", "cls", "mean", "tokens", "frames")
DTYPES = ("auto", "float32", "float16", "bfloat16")
OUT_DTYPES = ("float32", "float16", "bfloat16")
FORMATS = ("parquet", "safetensors")
CPU_FORWARDS = ("auto", "plain", "onednn")
#: a manifest line (or CSV record) larger than this is one 413 error row, read past, never loaded
DEFAULT_MAX_ROW_BYTES = 32 * 1024 * 1024
RESERVED_COLUMNS = frozenset({"id", "modality", "embedding"})
#: undecoded inline bytes (tar members, Parquet image bytes) waiting for or in the decode workers (--max-inflight-bytes)
DEFAULT_MAX_INFLIGHT_BYTES = 256 * 1024 * 1024
#: items per micro-batch where neither --batch-size nor the device's probe says (the CPU's)
DEFAULT_BATCH_SIZE = 32
#: the field metadata key of `option`'s classification
FINGERPRINT = "fingerprint"


def option(default: Any = MISSING, *, fingerprint: bool, factory: Callable[[], Any] | None = None,
           **kw: Any) -> Any:
    """A config field with its default and its classification: `fingerprint=True` when its value
    changes the vectors or the output's schema (recorded in run.json, checked on resume). Keyword
    only and required, so a new field cannot leave the question open."""
    metadata = {FINGERPRINT: fingerprint}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


@dataclass(frozen=True)
class ManifestConfig:
    """Which keys hold the id, image, text, audio and video (None: the input format's own,
    `readers.registry.Format.keys`), which fields to keep, how many rows."""

    id_key: str | None = option(None, fingerprint=False)
    image_key: str | None = option(None, fingerprint=False)
    text_key: str | None = option(None, fingerprint=False)
    audio_key: str | None = option(None, fingerprint=False)
    video_key: str | None = option(None, fingerprint=False)
    keep: tuple[str, ...] = option((), fingerprint=True)
    limit: int | None = option(None, fingerprint=False)
    #: CSV quoted fields may span lines: tasks parse from the top (exact, slower)
    csv_multiline: bool = option(False, fingerprint=False)
    max_row_bytes: int = option(DEFAULT_MAX_ROW_BYTES, fingerprint=False)

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise ConfigError("--limit must be >= 0")
        if self.max_row_bytes <= 0:
            raise ConfigError("--max-row-bytes must be > 0")
        bad = RESERVED_COLUMNS.intersection(self.keep)
        if bad:
            raise ConfigError(f"--keep cannot name reserved column(s): {', '.join(sorted(bad))}")
        if len(set(self.keep)) != len(self.keep):
            raise ConfigError("--keep names a field twice")


#: the largest file each medium may be, by default (--max-file-bytes, --max-audio-bytes, --max-video-bytes)
DEFAULT_MAX_BYTES = {"image": 64 * 1024 * 1024, "audio": 512 * 1024 * 1024, "video": 2 * 1024 * 1024 * 1024}
#: frames sampled from a video clip unless --frames says; with --fps, at most
DEFAULT_FRAMES, MAX_FPS_FRAMES = 8, 64
#: how images are decoded for a new output unless --decode says (a resumed one keeps its own)
DEFAULT_DECODE = "fast"


@dataclass(frozen=True)
class MediaConfig:
    """Limits and network behaviour for loading images, audio and video; how clips are sampled.

    `max_file_bytes` is the image limit; audio and video have their own (`limit_bytes`). A video
    on a local path is read only where its sampled frames are (seeking); one from a URL or inline
    bytes is held in memory whole, so its limit also bounds memory. `max_audio_seconds` None:
    the model's own window (CLAP: 10 s); `frames` None: `DEFAULT_FRAMES`;
    with `fps`, frames are taken at that rate, at most `frames` (else `MAX_FPS_FRAMES`) of them."""

    #: Pillow's own bomb threshold (~ 9459 x 9459); also per video frame
    max_image_pixels: int = option(89_478_485, fingerprint=False)
    max_file_bytes: int = option(DEFAULT_MAX_BYTES["image"], fingerprint=False)
    max_audio_bytes: int = option(DEFAULT_MAX_BYTES["audio"], fingerprint=False)
    max_video_bytes: int = option(DEFAULT_MAX_BYTES["video"], fingerprint=False)
    max_audio_seconds: float | None = option(None, fingerprint=True)
    max_video_seconds: float = option(3600.0, fingerprint=True)
    frames: int | None = option(None, fingerprint=True)
    fps: float | None = option(None, fingerprint=True)
    fetch_timeout: float = option(20.0, fingerprint=False)
    fetch_retries: int = option(3, fingerprint=False)
    #: reading, decoding, preprocessing one image; fetching has its own
    decode_timeout: float = option(60.0, fingerprint=False)
    #: "fast": a JPEG at least four times the model's input decodes at a reduced DCT scale, resizes
    #: run on torch's kernels;
    #: "exact": full decoding, the processor's own pixels; "gpu": JPEGs decoded and resized on the
    #: model's device; None: `DEFAULT_DECODE` for a new output, else what the output was written
    #: with (the run settles it, `run/metadata.decode_mode`)
    decode: str | None = option(None, fingerprint=True)
    #: the option `max_file_bytes` stands for (`limit_bytes`): what a payload over it is told
    limit_option: str = option("--max-file-bytes", fingerprint=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.decode not in (None, "fast", "exact", "gpu"):
            raise ConfigError(f"--decode must be fast, exact or gpu, not {self.decode!r}")
        if min(self.max_image_pixels, self.max_file_bytes, self.max_audio_bytes, self.max_video_bytes) <= 0:
            raise ConfigError("--max-image-pixels, --max-file-bytes, --max-audio-bytes and --max-video-bytes "
                              "must be > 0")
        if (self.max_audio_seconds is not None and self.max_audio_seconds <= 0) or self.max_video_seconds <= 0:
            raise ConfigError("--max-audio-seconds and --max-video-seconds must be > 0")
        if (self.frames is not None and self.frames <= 0) or (self.fps is not None and self.fps <= 0):
            raise ConfigError("--frames and --fps must be > 0")
        if self.decode_timeout <= 0:
            raise ConfigError("--decode-timeout must be > 0")
        if self.fetch_timeout <= 0 or self.fetch_retries < 0:
            raise ConfigError("--fetch-timeout must be > 0 and --fetch-retries >= 0")

    def frames_per_clip(self) -> int:
        """Frames a video clip gives: `--frames`, else (under --fps) `MAX_FPS_FRAMES`, else
        `DEFAULT_FRAMES` (recorded resolved in the output's fingerprint)."""
        if self.frames is not None:
            return self.frames
        return MAX_FPS_FRAMES if self.fps is not None else DEFAULT_FRAMES

    def limit_bytes(self, medium: str) -> "MediaConfig":
        """This config with `max_file_bytes` set to `medium`'s limit (the loaders read that one)."""
        if medium not in ("audio", "video"):
            return self
        limit = self.max_audio_bytes if medium == "audio" else self.max_video_bytes
        return replace(self, max_file_bytes=limit, limit_option=f"--max-{medium}-bytes")


@dataclass(frozen=True)
class ModelConfig:
    """What model to load and how to run it.

    The fields declared `fingerprint=True` change the vectors; `device`, `compile` and
    `cpu_forward` change only the arithmetic's order (float32 within 1e-5), so they are not.
    `cpu_forward`: `auto` times the run's own batches to choose between oneDNN's and PyTorch's
    linears, on two CPU streams; `plain` is PyTorch's own forward on one stream; `onednn` pins
    oneDNN's linears (see `encoders/cpu/`).
    """

    model: str = option(fingerprint=True)
    revision: str | None = option(None, fingerprint=True)
    pooling: str = option("auto", fingerprint=True)
    device: str = option("auto", fingerprint=False)
    dtype: str = option("auto", fingerprint=True)
    normalize: bool | None = option(None, fingerprint=True)  # None: the model's own convention, resolved at load time
    text_prefix: str = option("", fingerprint=True)
    max_length: int | None = option(None, fingerprint=True)
    trust_remote_code: bool = option(False, fingerprint=False)
    allow_pickle_weights: bool = option(False, fingerprint=False)
    compile: bool = option(False, fingerprint=False)
    cpu_forward: str = option("auto", fingerprint=False)

    def __post_init__(self) -> None:
        if self.cpu_forward not in CPU_FORWARDS:
            raise ConfigError(f"--cpu-forward must be one of {', '.join(CPU_FORWARDS)}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"--pooling must be one of {', '.join(POOLINGS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.max_length is not None and self.max_length <= 0:
            raise ConfigError("--max-length must be > 0")
        for dev in self.devices:
            if not (dev in ("auto", "cpu", "cuda", "mps") or dev.startswith("cuda:")):
                raise ConfigError(f"--device {dev!r}: expected auto, cpu, cuda, cuda:N or mps")

    @property
    def devices(self) -> tuple[str, ...]:
        """The comma-separated device list (one worker process per device when more than one)."""
        return tuple(d.strip() for d in self.device.split(",") if d.strip()) or ("auto",)


@dataclass(frozen=True)
class BatchConfig:
    """Micro-batching: batch size, token budget, workers and prefetch (by count, and by the
    undecoded inline bytes in flight: `max_inflight_bytes`)."""

    #: None: `DEFAULT_BATCH_SIZE` on the CPU; on CUDA the model's own choice at load
    #: (`Encoder.default_batch_size`: a short probe of forwards), recorded in the task metadata
    batch_size: int | None = option(None, fingerprint=False)
    max_batch_tokens: int | None = option(None, fingerprint=False)
    workers: int | None = option(None, fingerprint=False)  # None: a default from the CPU count
    prefetch_batches: int = option(4, fingerprint=False)
    grow_after: int = option(8, fingerprint=False)  # successes at a halved batch size before growing it back
    max_inflight_bytes: int = option(DEFAULT_MAX_INFLIGHT_BYTES, fingerprint=False)

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size <= 0:
            raise ConfigError("--batch-size must be > 0")
        if self.workers is not None and self.workers < 0:
            raise ConfigError("--workers must be >= 0")
        if self.prefetch_batches <= 0:
            raise ConfigError("prefetch must be > 0")
        if self.max_inflight_bytes <= 0:
            raise ConfigError("--max-inflight-bytes must be > 0")

    def size_for(self, choice: int | None) -> int:
        """The batch size of a run: `--batch-size` as given; else the encoder's `choice` for its
        device; else `DEFAULT_BATCH_SIZE`."""
        return self.batch_size or choice or DEFAULT_BATCH_SIZE

    def workers_per_device(self, devices: int = 1) -> int:
        """Decode worker processes of one device process: `--workers` (0: decode in-process), by
        default the CPUs this process may use less one for each device's encode loop, split
        between the device processes."""
        if self.workers == 0:
            return 0
        total = self.workers if self.workers is not None else usable_cpus() - devices
        return max(1, total // max(1, devices))


@dataclass(frozen=True)
class WriterConfig:
    """Output format and layout."""

    out: str = option(fingerprint=False)
    format: str = option("parquet", fingerprint=True)
    #: None: float32 for pooled vectors, float16 for token embeddings
    out_dtype: str | None = option(None, fingerprint=True)
    shard_size: int = option(10_000, fingerprint=False)
    #: fsspec options of an object-store OUT, as (key, value) pairs: never recorded (they may be secrets)
    storage_options: tuple[tuple[str, str], ...] = option((), fingerprint=False)
    #: the scheduler never runs one task twice at once: a store without exclusive create may hold OUT
    single_writer: bool = option(False, fingerprint=False)

    @property
    def store_options(self) -> dict[str, str]:
        """`storage_options` as fsspec takes them."""
        return dict(self.storage_options)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(FORMATS)}")
        if self.out_dtype is not None and self.out_dtype not in OUT_DTYPES:
            raise ConfigError(f"--out-dtype must be one of {', '.join(OUT_DTYPES)}")
        if self.format == "parquet" and self.out_dtype == "bfloat16":
            raise ConfigError("--out-dtype bfloat16 needs --format safetensors (Parquet has no bfloat16)")
        if self.shard_size <= 0:
            raise ConfigError("--shard-size must be > 0")


@dataclass(frozen=True)
class RunConfig:
    """Everything one `mmenc encode` run needs."""

    manifests: tuple[str, ...] = option(fingerprint=False)
    model: ModelConfig
    writer: WriterConfig
    manifest: ManifestConfig = field(default_factory=ManifestConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    modalities: tuple[str, ...] | None = option(None, fingerprint=False)  # None: every modality the model supports
    task_index: int = option(0, fingerprint=False)
    task_count: int = option(1, fingerprint=False)
    max_errors: int | None = option(None, fingerprint=False)
    max_error_rate: float | None = option(None, fingerprint=False)
    fail_fast: bool = option(False, fingerprint=False)
    overwrite: bool = option(False, fingerprint=False)
    wait_lock: bool = option(False, fingerprint=False)

    def __post_init__(self) -> None:
        if not self.manifests:
            raise ConfigError("give at least one manifest")
        if self.modalities is not None:
            bad = [m for m in self.modalities if m not in MODALITIES]
            if bad or not self.modalities:
                raise ConfigError(f"--modality takes a comma list of {', '.join(MODALITIES)}"
                                  + (f", not {', '.join(bad)}" if bad else ""))
        if self.task_count < 1 or not 0 <= self.task_index < self.task_count:
            raise ConfigError(f"task index {self.task_index} is not in [0, {self.task_count})")
        if self.max_error_rate is not None and not 0 <= self.max_error_rate <= 1:
            raise ConfigError("--max-error-rate must be between 0 and 1")
        if self.max_errors is not None and self.max_errors < 0:
            raise ConfigError("--max-errors must be >= 0")
        if self.model.pooling in ("tokens", "frames") and self.writer.format != "safetensors":
            raise ConfigError(f"--pooling {self.model.pooling} writes one tensor per item: use --format safetensors")

    def value_at(self, path: tuple[str, ...]) -> Any:
        """The option at `path` (as `config_fields` names it: ("media", "frames"))."""
        value: Any = self
        for name in path:
            value = getattr(value, name)
        return value

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy for the run metadata."""
        out = asdict(self)
        del out["media"]["limit_option"]  # a loader's detail, not an option
        out["writer"]["storage_options"] = sorted({k for k, _ in self.writer.storage_options})  # names, no values
        return out


def config_fields(cls: type = RunConfig, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Field[Any]]]:
    """Every option of `cls` with its path from a `RunConfig` (("model", "pooling")), in declaration
    order; the parts (`ModelConfig`, ...) are walked into, not listed."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            yield from config_fields(hints[f.name], (*prefix, f.name))
        else:
            yield (*prefix, f.name), f


def fingerprint_fields() -> tuple[tuple[str, ...], ...]:
    """The paths of the options declared `fingerprint=True`: what the output's fingerprint holds."""
    return tuple(path for path, f in config_fields() if f.metadata.get(FINGERPRINT))
