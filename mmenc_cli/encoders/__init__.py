"""Model adapters: `load_encoder(cfg)` picks a model family and returns a loaded `Encoder`.

Importing this package is cheap: torch and transformers are imported only inside the functions
that load a model. Families are tried in `FAMILIES` order; each names its loader as
"module:function" so only the chosen family's code is imported. Built in:

* `sentence-transformers`: a folder (or hub repo) with `modules.json` (Transformer, Pooling,
  optional Normalize): text only (`sentence.py`).
* `clip`: CLIP, SigLIP, SigLIP 2: image and text, projected pooled embeddings (`hf.py`).
* `vision`: image-only backbones (ViT, DINOv2, ...) with `auto`/`cls`/`mean` pooling (`hf.py`).

A new adapter (e.g. Qwen2-VL token embeddings for `--pooling tokens`) plugs in with
`register_family(Family(...))` or one entry in `FAMILIES`.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .base import EncodeOutput, Encoder, ImageInput, ImagePreprocessor


class ModelLoadError(RuntimeError):
    """The model cannot be loaded or used as asked (a run-level startup error, one clear line)."""


from .device import resolve_device, resolve_dtype  # noqa: E402  (needs ModelLoadError defined)

if TYPE_CHECKING:  # pragma: no cover
    from ..config import ModelConfig

__all__ = ["DUAL_TOWER_TYPES", "EncodeOutput", "Encoder", "FAMILIES", "Family", "ImageInput",
           "ImagePreprocessor", "ModelLoadError", "ModelProbe", "fetch_file", "load_encoder",
           "probe_model", "register_family", "resolve_device", "resolve_dtype"]

#: model types served by the CLIP-style dual-tower adapter
DUAL_TOWER_TYPES = frozenset({"clip", "siglip", "siglip2"})


@dataclass(frozen=True)
class ModelProbe:
    """What a family needs to recognise a model, read before any weights load.

    `source` is a local directory (absolute) or a hub id; `st_modules` the parsed `modules.json`
    of a sentence-transformers model (None otherwise); `config` the transformers config of the
    (transformer module of the) model; `commit` the resolved hub commit, None for local folders.
    """

    source: str
    revision: str | None
    config: Any
    model_type: str | None
    st_modules: list[dict[str, Any]] | None
    commit: str | None


@dataclass(frozen=True)
class Family:
    """A model family: how to recognise it, the poolings it supports, and its loader.

    `loader` is "module:function" (relative to this package when it starts with "."); the function
    takes `(probe, cfg, device)` and returns an `Encoder`.
    """

    name: str
    matches: Callable[[ModelProbe], bool]
    loader: str
    poolings: frozenset[str]


def _is_vision_backbone(probe: ModelProbe) -> bool:
    """An image-only config: has image channels and no text tower."""
    config = probe.config
    return config is not None and hasattr(config, "num_channels") and not hasattr(config, "text_config")


FAMILIES: list[Family] = [
    Family("sentence-transformers", lambda p: p.st_modules is not None, ".sentence:load",
           frozenset({"auto", "cls", "mean"})),
    Family("qwen2-vl", lambda p: p.model_type in ("qwen2_vl", "qwen2_5_vl"), ".qwen_vl:load",
           frozenset({"tokens", "mean"})),
    Family("clip", lambda p: p.model_type in DUAL_TOWER_TYPES, ".hf:load_dual", frozenset({"auto"})),
    Family("vision", _is_vision_backbone, ".hf:load_vision", frozenset({"auto", "cls", "mean"})),
]


def register_family(family: Family) -> None:
    """Add a family ahead of the built-in ones (so it can also take over a built-in model type)."""
    FAMILIES.insert(0, family)


def load_encoder(cfg: "ModelConfig", device: str | None = None) -> Encoder:
    """Load `cfg.model` once, in eval mode, on `device` (default: the first of `cfg.devices`).

    Raises `ModelLoadError` for a missing folder, an unreachable hub, an unsupported model or
    pooling, weights that cannot load, or a model that fails a one-item test encode.
    """
    probe = probe_model(cfg)
    family = next((f for f in FAMILIES if f.matches(probe)), None)
    if family is None:
        raise ModelLoadError(
            f"unsupported model {cfg.model!r} (model_type {probe.model_type!r}): mmenc encodes CLIP/SigLIP, "
            "image backbones (ViT, DINOv2, ...) and sentence-transformers models")
    if cfg.pooling not in family.poolings:
        raise ModelLoadError(f"--pooling {cfg.pooling} is not supported for {family.name} models "
                             f"(supported: {', '.join(sorted(family.poolings))})")
    from .device import configure_backend

    resolved = resolve_device(device or cfg.devices[0])
    configure_backend(resolved)
    module, _, function = family.loader.partition(":")
    loader = getattr(importlib.import_module(module, __name__), function)
    try:
        return loader(probe, cfg, resolved)
    except ModelLoadError:
        raise
    except Exception as exc:  # anything else while loading is still a startup failure
        raise ModelLoadError(f"cannot load model {cfg.model!r}: {type(exc).__name__}: {exc}") from exc


def probe_model(cfg: "ModelConfig") -> ModelProbe:
    """Locate the model and read its config (and `modules.json`), without loading weights."""
    source = cfg.model
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model path {source!r} is not a directory")
        source = str(path.resolve())
    elif _looks_like_path(source):
        raise ModelLoadError(f"model directory not found: {source}")

    modules_file = fetch_file(source, "modules.json", cfg.revision)
    st_modules = None
    subfolder = ""
    if modules_file is not None:
        try:
            st_modules = sorted(json.loads(modules_file.read_text()), key=lambda m: m.get("idx", 0))
        except (ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{source}: modules.json is not valid: {exc}") from exc
        first = st_modules[0] if st_modules else {}
        if not str(first.get("type", "")).endswith(".Transformer"):
            # not a transformers-backed model: the sentence-transformers family explains why
            return ModelProbe(source, cfg.revision, None, None, st_modules, _commit_of(modules_file))
        subfolder = first.get("path", "") or ""

    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, revision=cfg.revision, subfolder=subfolder,
                                            trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:  # OSError (missing, offline), ValueError (unknown type, remote code)
        text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise ModelLoadError(f"cannot load model {cfg.model!r}: {text}") from exc
    commit = _commit_of(fetch_file(source, "config.json", cfg.revision, subfolder))
    return ModelProbe(source, cfg.revision, config, getattr(config, "model_type", None), st_modules, commit)


def fetch_file(source: str, filename: str, revision: str | None = None, subfolder: str = "") -> Path | None:
    """A file of the model (local folder or hub cache/download), or None when it has none."""
    local = Path(source)
    if local.is_dir():
        path = local / subfolder / filename
        return path if path.is_file() else None
    from transformers.utils import cached_file

    try:
        found = cached_file(source, filename, revision=revision, subfolder=subfolder,
                            _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False,
                            _raise_exceptions_for_gated_repo=False)
    except Exception:  # unreachable or invalid id: the config load that follows says why
        return None
    return Path(found) if found else None


def _looks_like_path(source: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that does not exist is a missing folder."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or os.sep != "/" and os.sep in source


def _commit_of(path: Path | None) -> str | None:
    """The commit hash of a file in the hub cache (`.../snapshots/<commit>/...`)."""
    parts = path.parts if path is not None else ()
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else None
