"""timm image backbones through the `timm` library: pooled image embeddings.

`timm:NAME` (a registry name with its pretrained tag), `timm:hf-hub:ORG/NAME[@REVISION]`, a
folder timm wrote (`config.json` with `architecture`, `model.safetensors`), or a hub repository of
timm's (`libraries.split_model`). The model is `timm.create_model(..., pretrained=True)`, its
input timm's own evaluation transform (`resolve_model_data_config` + `create_transform`, split
into the uint8 worker path where it is resize + center crop + normalize).

Pooling: `auto` is the model's pre-logits features, what timm's own head pools
(`forward_head(forward_features(x), pre_logits=True)`); for ViT-style models (tokens with a
prefix) `cls` is the first token of `forward_features` and `mean` the mean of its patch tokens,
prefix tokens (class, registers, distillation) left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelLoadError, first_line
from .device import resolve_dtype
from .forward import Inputs
from .libraries import check_weights, hub_file, import_library
from .loading import ModelProbe
from .torch_encoder import TorchEncoder
from .tv_transform import plan_transform

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

#: what timm looks for in a folder, safetensors first
_FOLDER_NAMES = ("model.safetensors", "open_clip_model.safetensors", "pytorch_model.bin", "model.pth",
                 "pytorch_model.pth", "open_clip_pytorch_model.bin")


class TimmEncoder(TorchEncoder):
    """A timm backbone: pre-logits features (`auto`), or its first or mean patch token."""

    family = "timm"
    towers = frozenset({"image"})
    library = "timm"

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 transform: Any) -> None:
        self._pooling = cfg.pooling
        self._prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
        super().__init__(probe, cfg, device, model, images=plan_transform(transform), text=False,
                         default_normalize=False, pooling=cfg.pooling if cfg.pooling != "auto" else "pre_logits")

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        features = self.model.forward_features(inputs["pixel_values"])
        if self._pooling == "auto":
            return self.model.forward_head(features, pre_logits=True)
        if self._pooling == "cls":
            return features[:, 0]
        return features[:, self._prefix:].mean(dim=1)


def load(name: str, cfg: "ModelConfig", device: str) -> TimmEncoder:
    """Load a timm model by its name in timm's terms (`split_model`)."""
    timm = import_library("timm")
    if cfg.revision is not None:
        if not name.startswith("hf-hub:") or "@" in name:
            raise ModelLoadError(f"--revision names a hub revision; {cfg.model} is not a hub repository "
                                 "without one (timm's own form: timm:hf-hub:ORG/NAME@REVISION)")
        name = f"{name}@{cfg.revision}"
    commit = check_weights(cfg.model, _weights(timm, name), cfg.allow_pickle_weights)
    try:
        model = timm.create_model(name, pretrained=True)
        data = timm.data.resolve_model_data_config(model)
        transform = timm.data.create_transform(**data, is_training=False)
    except Exception as exc:  # RuntimeError (unknown model), OSError (no files), ValueError, ...
        raise ModelLoadError(f"cannot load model {cfg.model!r}: {first_line(exc)}") from exc
    _check_pooling(cfg, model)
    model = model.to(device=device, dtype=resolve_dtype(cfg.dtype, device)).eval()
    arch = getattr(model, "pretrained_cfg", {}).get("architecture") or type(model).__name__
    probe = ModelProbe(cfg.model, cfg.revision, None, f"timm:{arch}", None, commit)
    return TimmEncoder(probe, cfg, device, model, transform=transform)


def _check_pooling(cfg: "ModelConfig", model: Any) -> None:
    """`cls` and `mean` need tokens with a known prefix (ViT-style); `cls` a class token."""
    prefix = getattr(model, "num_prefix_tokens", None)
    if cfg.pooling == "cls" and not (prefix and getattr(model, "cls_token", None) is not None):
        raise ModelLoadError(f"--pooling cls needs a ViT-style model with a class token; {cfg.model} has "
                             "none: use --pooling auto (timm's pre-logits features)")
    if cfg.pooling == "mean" and prefix is None:
        raise ModelLoadError(f"--pooling mean is defined for ViT-style (token) models, not {cfg.model}: "
                             "use --pooling auto (timm's pre-logits features)")


def _weights(timm: Any, name: str) -> str | None:
    """The weight file timm will load for this name (safetensors first, as it does)."""
    if name.startswith("local-dir:"):
        folder = Path(name.removeprefix("local-dir:"))
        return next((str(folder / n) for n in _FOLDER_NAMES if (folder / n).is_file()), None)
    if name.startswith("hf-hub:"):
        repo, _, revision = name.removeprefix("hf-hub:").partition("@")
        return hub_file(repo, ("model.safetensors", "pytorch_model.bin"), revision or None)
    pretrained = timm.models.get_pretrained_cfg(name)
    if pretrained is None:
        raise ModelLoadError(f"timm:{name}: timm knows no model {name!r} with pretrained weights "
                             "(timm.list_pretrained() lists them)")
    if pretrained.hf_hub_id:
        filename = pretrained.hf_hub_filename or "pytorch_model.bin"
        safe = "model.safetensors" if filename == "pytorch_model.bin" else None
        return hub_file(pretrained.hf_hub_id, tuple(n for n in (safe, filename) if n))
    return pretrained.file or pretrained.url or None
