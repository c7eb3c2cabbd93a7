"""Model adapters: `load_encoder(cfg)` picks a model family and returns a loaded `Encoder`.

Importing this package is cheap: torch and transformers are imported only inside the functions
that load a model. Families are tried in `FAMILIES` order; each names its loader as
"module:function", imported only when that family is chosen. Built in:

* `sentence-transformers`: a folder (or hub repo) with `modules.json` (Transformer, Pooling,
  optional Normalize): text only (`sentence.py`).
* `qwen2-vl`: Qwen2-VL / Qwen2.5-VL vision towers, token-level or mean-pooled (`qwen_vl.py`).
* `clip`: CLIP, SigLIP, SigLIP 2: image and text, projected pooled embeddings (`clip.py`).
* `clap`: CLAP: audio and text, projected pooled embeddings (`clap.py`).
* `vision`: image-only backbones (ViT, DINOv2, ...) with `auto`/`cls`/`mean` pooling (`vision.py`).

Models other libraries build are named for them (`libraries.split_model`): OpenCLIP
(`openclip.py`) and timm (`timm_backbone.py`), each an optional extra.

The transformers-backed families share `hf.HFEncoder`; every adapter derives from `base.Encoder`,
which declares all the run code may call. `register_family` adds a family ahead of these.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ModelLoadError
from .base import EncodeOutput, Encoder, ImageInput, ImagePreprocessor
from .device import configure_backend, resolve_device, resolve_dtype
from .libraries import split_model
from .loading import ModelProbe, fetch_file, probe_model

if TYPE_CHECKING:  # pragma: no cover
    from ..config import ModelConfig

__all__ = ["DUAL_TOWER_TYPES", "EncodeOutput", "Encoder", "FAMILIES", "Family", "ImageInput",
           "ImagePreprocessor", "ModelLoadError", "ModelProbe", "fetch_file", "load_encoder",
           "probe_model", "register_family", "resolve_device", "resolve_dtype"]

#: model types served by the CLIP-style dual-tower adapter
DUAL_TOWER_TYPES = frozenset({"clip", "siglip", "siglip2"})


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
    Family("clip", lambda p: p.model_type in DUAL_TOWER_TYPES, ".clip:load", frozenset({"auto"})),
    Family("clap", lambda p: p.model_type == "clap", ".clap:load", frozenset({"auto"})),
    Family("vision", _is_vision_backbone, ".vision:load", frozenset({"auto", "cls", "mean"})),
]


def register_family(family: Family) -> None:
    """Add a family ahead of the built-in ones (so it can also take over a built-in model type)."""
    FAMILIES.insert(0, family)


#: families another library builds (`libraries.py`): loader "module:function" taking
#: `(name, cfg, device)`, and the poolings they support
LIBRARY_FAMILIES: dict[str, tuple[str, frozenset[str]]] = {
    "open_clip": (".openclip:load", frozenset({"auto"})),
    "timm": (".timm_backbone:load", frozenset({"auto", "cls", "mean"})),
}


def load_encoder(cfg: "ModelConfig", device: str | None = None) -> Encoder:
    """Load `cfg.model` once, in eval mode, on `device` (default: the first of `cfg.devices`).

    Raises `ModelLoadError` for a missing folder, an unreachable hub, an unsupported model or
    pooling, weights that cannot load, or a model that fails a one-item test encode.
    """
    if cfg.pooling == "frames":  # the model's own adapter, its per-frame outputs kept apart
        from dataclasses import replace

        from .clip_batches import FramesEncoder

        try:
            inner = load_encoder(replace(cfg, pooling="auto"), device)
        except ModelLoadError as exc:
            raise ModelLoadError(f"--pooling frames: {exc}") from exc
        return FramesEncoder(inner)
    library, name = split_model(cfg.model)
    probe = probe_model(cfg) if library is None else None
    if probe is not None and probe.model_type == "timm_wrapper":  # a timm repository on the hub
        library, name = "timm", f"hf-hub:{probe.source}"
    if library is not None:
        loader, poolings = LIBRARY_FAMILIES[library]
        return _load(loader, poolings, library, cfg, device, name)
    assert probe is not None
    family = next((f for f in FAMILIES if f.matches(probe)), None)
    if family is None:
        raise ModelLoadError(
            f"unsupported model {cfg.model!r} (model_type {probe.model_type!r}): mmenc encodes CLIP/SigLIP, CLAP, "
            "image backbones (ViT, DINOv2, ...), sentence-transformers models, and OpenCLIP and timm "
            "models (open_clip:NAME, timm:NAME)")
    return _load(family.loader, family.poolings, family.name, cfg, device, probe)


def _load(loader: str, poolings: frozenset[str], name: str, cfg: "ModelConfig", device: str | None,
          what: Any) -> Encoder:
    """Check the pooling, settle the device, and call `loader` with `what` (a probe, or a name)."""
    if cfg.pooling not in poolings:
        raise ModelLoadError(f"--pooling {cfg.pooling} is not supported for {name} models "
                             f"(supported: {', '.join(sorted(poolings))})")
    resolved = resolve_device(device or cfg.devices[0])
    configure_backend(resolved)
    module, _, function = loader.partition(":")
    load = getattr(importlib.import_module(module, __name__), function)
    try:
        return load(what, cfg, resolved)
    except ModelLoadError:
        raise
    except Exception as exc:  # anything else while loading is still a startup failure
        raise ModelLoadError(f"cannot load model {cfg.model!r}: {type(exc).__name__}: {exc}") from exc
