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
    """CLIP, SigLIP and SigLIP 2: `get_image_features` / `get_text_features` (projected, pooled);
    a subclass names other towers (CLAP: `get_audio_features`).

    SigLIP's text tower pools the last position and was trained on texts padded to the full
    length, so its texts are padded to `max_length` as SigLIP's documentation prescribes.
    """

    family = "clip"
    towers = frozenset({"image", "text"})
    #: modality -> the model's method giving that tower's projected, pooled features
    FEATURES = {"image": "get_image_features", "text": "get_text_features", "audio": "get_audio_features"}

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any,
                 **kwargs: Any) -> None:
        self._features = {m: getattr(model, self.FEATURES[m]) for m in self.towers}
        self._keys = {m: keep_accepted(fn) for m, fn in self._features.items()}
        super().__init__(probe, cfg, device, model, **kwargs)

    def _tower(self, modality: str, inputs: Inputs) -> "torch.Tensor":
        return pooled(self._features[modality](**self._keys[modality](inputs)))

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        return self._tower("image", inputs)

    def _embed_text(self, inputs: Inputs) -> "torch.Tensor":
        return self._tower("text", inputs)

    def _embed_audio(self, inputs: Inputs) -> "torch.Tensor":
        return self._tower("audio", inputs)


def load_towers(probe: ModelProbe, cfg: "ModelConfig", device: str,
                other: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    """A dual-tower model, its tokenizer and its `other` part ("image": the image processor,
    "audio": the feature extractor), whichever exist, and the text limit and what is missing as
    keyword arguments for the encoder."""
    model, _ = load_model(probe, cfg, device, resolve_dtype(cfg.dtype, device))
    tokenizer, no_text = load_part("text", probe, cfg)
    part, no_part = load_part(other, probe, cfg)
    max_length = None
    if tokenizer is not None:
        text_config = getattr(probe.config, "text_config", probe.config)
        max_length = text_limit(tokenizer, text_config, None, cfg.max_length)
    unavailable = {k: v for k, v in (("text", no_text), (other, no_part)) if v}
    return model, tokenizer, part, {"max_length": max_length, "unavailable": unavailable}


def load(probe: ModelProbe, cfg: "ModelConfig", device: str) -> HFEncoder:
    """Load a CLIP / SigLIP / SigLIP 2 model with whichever of its two processors exist."""
    model, tokenizer, processor, text = load_towers(probe, cfg, device, "image")
    return DualTowerEncoder(probe, cfg, device, model, tokenizer=tokenizer, image_processor=processor,
                            pad_to_max_length=probe.model_type != "clip", default_normalize=True,
                            pooling="projection", **text)
