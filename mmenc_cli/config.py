"""Frozen, validated configuration for one run; saved with the run's metadata.

Options reach the core as one `RunConfig`, never as a splat of keyword arguments. Each part is
validated in `__post_init__` so a bad combination fails before anything is loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

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


@dataclass(frozen=True)
class ManifestConfig:
    """Which keys hold the id, image, text, audio and video (None: the input format's own,
    `readers.validate.keys_for`), which fields to keep, how many rows."""

    id_key: str | None = None
    image_key: str | None = None
    text_key: str | None = None
    audio_key: str | None = None
    video_key: str | None = None
    keep: tuple[str, ...] = ()
    limit: int | None = None
    csv_multiline: bool = False  # CSV quoted fields may span lines: tasks parse from the top (exact, slower)
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES

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


@dataclass(frozen=True)
class MediaConfig:
    """Limits and network behaviour for loading images, audio and video; how clips are sampled.

    `max_file_bytes` is the image limit; audio and video have their own (`limit_bytes`). A video
    on a local path is read only where its sampled frames are (seeking); one from a URL or inline
    bytes is held in memory whole, so its limit also bounds memory. `max_audio_seconds` None:
    the model's own window (CLAP: 10 s); `frames` None: `DEFAULT_FRAMES`;
    with `fps`, frames are taken at that rate, at most `frames` (else `MAX_FPS_FRAMES`) of them."""

    max_image_pixels: int = 89_478_485  # Pillow's own bomb threshold (~ 9459 x 9459); also per video frame
    max_file_bytes: int = DEFAULT_MAX_BYTES["image"]
    max_audio_bytes: int = DEFAULT_MAX_BYTES["audio"]
    max_video_bytes: int = DEFAULT_MAX_BYTES["video"]
    max_audio_seconds: float | None = None
    max_video_seconds: float = 3600.0
    frames: int | None = None
    fps: float | None = None
    fetch_timeout: float = 20.0
    fetch_retries: int = 3
    decode_timeout: float = 60.0  # reading, decoding, preprocessing one image; fetching has its own
    #: "fast": a JPEG at least four times the model's input decodes at a reduced DCT scale, resizes
    #: run on torch's kernels;
    #: "exact": full decoding, the processor's own pixels; "gpu": JPEGs decoded and resized on the
    #: model's device; None: fast for a new output, else what the output was written with (the run
    #: settles it, `run/metadata.decode_mode`)
    decode: str | None = None
    #: the option `max_file_bytes` stands for (`limit_bytes`): what a payload over it is told
    limit_option: str = field(default="--max-file-bytes", repr=False, compare=False)

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

    The fingerprint (`run/metadata.py`) holds the fields that change the vectors; `device`,
    `compile` and `cpu_forward` change only the arithmetic's order (float32 within 1e-5).
    `cpu_forward`: `auto` times the run's own batches to choose between oneDNN's and PyTorch's
    linears, on two CPU streams; `plain` is PyTorch's own forward on one stream; `onednn` pins
    oneDNN's linears (see `encoders/cpu/`).
    """

    model: str
    revision: str | None = None
    pooling: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    normalize: bool | None = None  # None: the model's own convention, resolved at load time
    text_prefix: str = ""
    max_length: int | None = None
    trust_remote_code: bool = False
    allow_pickle_weights: bool = False
    compile: bool = False
    cpu_forward: str = "auto"

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

    batch_size: int = 32
    max_batch_tokens: int | None = None
    workers: int | None = None  # None: a default from the CPU count
    prefetch_batches: int = 4
    grow_after: int = 8  # successes at a halved batch size before growing it back
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ConfigError("--batch-size must be > 0")
        if self.workers is not None and self.workers < 0:
            raise ConfigError("--workers must be >= 0")
        if self.prefetch_batches <= 0:
            raise ConfigError("prefetch must be > 0")
        if self.max_inflight_bytes <= 0:
            raise ConfigError("--max-inflight-bytes must be > 0")

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

    out: str
    format: str = "parquet"
    out_dtype: str | None = None  # None: float32 for pooled vectors, float16 for token embeddings
    shard_size: int = 10_000

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

    manifests: tuple[str, ...]
    model: ModelConfig
    writer: WriterConfig
    manifest: ManifestConfig = field(default_factory=ManifestConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    modalities: tuple[str, ...] | None = None  # None: every modality the model supports
    task_index: int = 0
    task_count: int = 1
    max_errors: int | None = None
    max_error_rate: float | None = None
    fail_fast: bool = False
    overwrite: bool = False
    wait_lock: bool = False

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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy for the run metadata."""
        out = asdict(self)
        del out["media"]["limit_option"]  # a loader's detail, not an option
        return out
