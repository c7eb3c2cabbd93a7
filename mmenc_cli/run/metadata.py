"""The run's records of itself: the options fingerprint, the output's facts, task metadata, versions.

`run.json` (written once per output) holds the fingerprint of the options that change the vectors
or the schema, the facts of the model that made them and the config; every later run must match
its fingerprint (`admission.py`). `tasks/task-NNNNN.json` is rewritten at each task's start and
end (`task_record`): state, counters, seconds, versions, the config and how the forward ran.
"""

from __future__ import annotations

import os
import platform
from typing import Any

from .. import __version__
from ..clock import timestamp
from ..config import DEFAULT_DECODE, RunConfig, fingerprint_fields
from ..errors import ConfigError
from ..encoders.base import Encoder
from ..encoders.libraries import model_path
from .counters import Counters, RunResult
from .model_identity import is_legacy, legacy_identity, model_identity, model_stamp


#: what a fingerprint written before a key existed means by its absence: how mmenc worked then,
#: so these stay as they are when a default changes
LEGACY_FINGERPRINT = {"decode": "exact", "frames": 8, "fps": None, "max_audio_seconds": None,
                      "max_video_seconds": 3600.0}


def decode_mode(cfg: RunConfig, recorded: dict[str, Any] | None) -> str:
    """`--decode` as given; else the mode the output was written with (an output from before the
    option existed decoded exactly); else `DEFAULT_DECODE`."""
    if cfg.media.decode is not None:
        return cfg.media.decode
    if isinstance(recorded, dict) and isinstance(recorded.get("fingerprint"), dict):
        return str(recorded["fingerprint"].get("decode", LEGACY_FINGERPRINT["decode"]))
    return DEFAULT_DECODE


#: the fingerprinted options recorded otherwise than as their value (the others: `{name: value}`),
#: each a function of the config and the resolved dtype
RECORDED = {
    # a local folder by what it holds, never where it lies (`model_identity.py`)
    ("model", "model"): lambda cfg, dtype: model_identity(cfg.model.model),
    ("model", "dtype"): lambda cfg, dtype: {"dtype": dtype},  # "auto" means another dtype per device
    ("manifest", "keep"): lambda cfg, dtype: {"keep": list(cfg.manifest.keep)},
    # no --frames means a count that --fps changes: the count itself is what shapes the vectors
    ("media", "frames"): lambda cfg, dtype: {"frames": cfg.media.frames_per_clip()},
}


def fingerprint(cfg: RunConfig, dtype: str) -> dict[str, Any]:
    """The options the config declares `fingerprint=True` (`config.fingerprint_fields`), by name,
    as `RECORDED` says or as their value; `dtype` is the one resolved for the device, and the
    decode mode must be settled already (`decode_mode`). ConfigError for `--revision` with a local
    folder, which has no revisions to pick from."""
    m = cfg.model
    if m.revision is not None and model_path(m.model) is not None:
        raise ConfigError(f"--revision {m.revision} names a hub revision, but {m.model} is a local folder: "
                          "drop --revision, or give the hub id")
    fp: dict[str, Any] = {}
    for path in fingerprint_fields():
        record = RECORDED.get(path)
        fp.update(record(cfg, dtype) if record else {path[-1]: cfg.value_at(path)})
    return fp


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any], model: str | None = None) -> list[str]:
    """Human-readable differences between an output's recorded fingerprint and this run's, over
    this run's keys (a key missing from the old one means its `LEGACY_FINGERPRINT` value). With
    `model` (`--model`), a local folder the old fingerprint names the earlier way (its path and a
    stamp of its sizes) is compared that way."""
    if model is not None and is_legacy(old):
        new = {**new, **(legacy_identity(model) or {})}
    old = {**LEGACY_FINGERPRINT, **old}
    return [f"{k}: output has {old.get(k)!r}, this run {new.get(k)!r}" for k in new if old.get(k) != new.get(k)]


def resolved_dtype(cfg: RunConfig, device: str) -> str:
    """The compute dtype name a run on `device` uses (imports torch only to resolve an 'auto' device)."""
    dtype = cfg.model.dtype
    if dtype != "auto":
        return dtype
    if device in ("cpu", "mps"):
        return "float32"
    from ..encoders.device import resolve_device, resolve_dtype

    return str(resolve_dtype("auto", resolve_device(device))).replace("torch.", "")


def model_facts(cfg: RunConfig, enc: Encoder, dtype: str) -> dict[str, Any]:
    """The facts of the model that makes this output's vectors (run.json and every shard's metadata)."""
    info = dict(enc.info)
    normalize = cfg.model.normalize
    if normalize is None:
        normalize = bool(enc.default_normalize)
    out_dtype = cfg.writer.out_dtype or ("float16" if enc.output_kind == "tokens" else "float32")
    stamp = model_stamp(cfg.model.model)
    revision = info.get("commit") or info.get("revision") or (f"local:{stamp}" if stamp else None)
    return {**info, "model": cfg.model.model, "revision": revision, "dim": int(enc.dim),
            "modalities": sorted(enc.modalities), "normalize": normalize, "dtype": dtype,
            "pooling": info.get("pooling", cfg.model.pooling),
            "out_dtype": out_dtype, "output_kind": enc.output_kind, "mmenc_version": __version__}


#: libraries whose version can change the vectors (a resume under another version warns)
VECTOR_LIBRARIES = ("torch", "transformers", "open_clip_torch", "timm", "torchvision")


def version_changes(recorded: dict[str, str] | None) -> list[tuple[str, str, str]]:
    """(library, version the output was started with, version now) of each library that shapes
    the vectors and changed since."""
    now = library_versions()
    recorded = recorded if isinstance(recorded, dict) else {}
    return [(name, str(recorded[name]), now[name]) for name in VECTOR_LIBRARIES
            if name in recorded and name in now and str(recorded[name]) != now[name]]


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape the vectors, for the run metadata."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"mmenc": __version__, "python": platform.python_version()}
    for name in ("torch", "transformers", "pillow", "pyarrow", "safetensors", "numpy", *VECTOR_LIBRARIES[2:]):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def task_record(cfg: RunConfig, state: str, counters: Counters, elapsed: float,
                result: RunResult | None = None, error: str | None = None) -> dict[str, Any]:
    """The task's record of itself (`tasks/task-NNNNN.json`): state, counts, progress (`{done,
    total, unit}` of its slice, `Counters.progress`; None when the size is unknown), timings, versions."""
    return {"task": cfg.task_index, "task_count": cfg.task_count, "state": state, "host": platform.node(),
            "pid": os.getpid(), "updated": timestamp(), "manifests": list(cfg.manifests),
            "devices": list(cfg.model.devices), "counters": counters.to_dict(), "progress": counters.progress,
            "elapsed": elapsed,
            "versions": library_versions(), "config": cfg.to_dict(),
            "threshold_exceeded": result.threshold_exceeded if result else None,
            "model_loaded": result.model_loaded if result else None,
            "forward": result.forward if result else None, "error": error,
            "batch_size": result.batch_size if result else None,
            "events": (result.events if result else [])[-50:]}
