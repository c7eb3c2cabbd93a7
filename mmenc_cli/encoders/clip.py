"""CLIP, SigLIP and SigLIP 2 through transformers: projected, pooled image and text embeddings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .device import resolve_dtype
from .hf import HFEncoder, Inputs, keep_accepted, pooled
from .loading import ModelProbe, load_model, load_part, text_limit

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig


class DualTowerEncoder(HFEncoder):
    """CLIP, SigLIP and SigLIP 2: `get_image_features` / `get_text_features` (projected, pooled).

    SigLIP's text tower pools the last position and was trained on texts padded to the full
    length, so its texts are padded to `max_length` as SigLIP's documentation prescribes.
    """

    family = "clip"
    towers = frozenset({"image", "text"})

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any,
                 **kwargs: Any) -> None:
        self._image_keys = keep_accepted(model.get_image_features)
        self._text_keys = keep_accepted(model.get_text_features)
        super().__init__(probe, cfg, device, model, **kwargs)

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        return pooled(self.model.get_image_features(**self._image_keys(inputs)))

    def _embed_text(self, inputs: Inputs) -> "torch.Tensor":
        return pooled(self.model.get_text_features(**self._text_keys(inputs)))


def load(probe: ModelProbe, cfg: "ModelConfig", device: str) -> HFEncoder:
    """Load a CLIP / SigLIP / SigLIP 2 model with whichever of its two processors exist."""
    model, _ = load_model(probe, cfg, device, resolve_dtype(cfg.dtype, device))
    tokenizer, no_text = load_part("text", probe, cfg)
    processor, no_image = load_part("image", probe, cfg)
    max_length = None
    if tokenizer is not None:
        text_config = getattr(probe.config, "text_config", probe.config)
        max_length = text_limit(tokenizer, text_config, None, cfg.max_length)
    unavailable = {k: v for k, v in (("text", no_text), ("image", no_image)) if v}
    return DualTowerEncoder(probe, cfg, device, model, tokenizer=tokenizer, image_processor=processor,
                            max_length=max_length, pad_to_max_length=probe.model_type != "clip",
                            default_normalize=True, pooling="projection", unavailable=unavailable)
