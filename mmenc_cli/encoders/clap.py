"""CLAP through transformers: projected, pooled audio and text embeddings.

Audio: each clip's features come from the model's own feature extractor, run in the decode
workers on one clip at a time (`ExtractorAudio`). The extractor crops clips longer than its
window (10 s for the released CLAP models) at a random place; mmenc never gives it one: clips
are cut to their first window-length seconds when decoded (counted as truncated), so the
features are deterministic. A fusion model (`enable_fusion`) still takes its fusion path, on the
clip as the extractor prepares one clip alone (`is_longer` set, as it sets it for a batch of one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .base import AudioInput, AudioPreprocessor
from .device import resolve_dtype
from .hf import HFEncoder, Inputs, keep_accepted, pooled
from .loading import ModelProbe, load_model, load_part, text_limit

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig


class ExtractorAudio(AudioPreprocessor):
    """A transformers audio feature extractor, for one clip at a time in the decode workers
    (picklable; unpickling it imports transformers, and with it torch, in the worker)."""

    def __init__(self, extractor: Any) -> None:
        self.extractor = extractor
        self.sample_rate = int(extractor.sampling_rate)
        samples = getattr(extractor, "nb_max_samples", None)
        self.window_seconds = samples / self.sample_rate if samples else None

    def __call__(self, samples: np.ndarray) -> AudioInput:
        out = self.extractor(samples, sampling_rate=self.sample_rate, return_tensors="np")
        return AudioInput({key: np.asarray(value)[0] for key, value in out.items()})


class ClapEncoder(HFEncoder):
    """CLAP: `get_audio_features` / `get_text_features` (projected, pooled)."""

    family = "clap"
    towers = frozenset({"audio", "text"})

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, **kwargs: Any) -> None:
        self._audio_keys = keep_accepted(model.get_audio_features)
        self._text_keys = keep_accepted(model.get_text_features)
        super().__init__(probe, cfg, device, model, **kwargs)

    def _embed_audio(self, inputs: Inputs) -> "torch.Tensor":
        return pooled(self.model.get_audio_features(**self._audio_keys(inputs)))

    def _embed_text(self, inputs: Inputs) -> "torch.Tensor":
        return pooled(self.model.get_text_features(**self._text_keys(inputs)))


def load(probe: ModelProbe, cfg: "ModelConfig", device: str) -> HFEncoder:
    """Load a CLAP model with its tokenizer and feature extractor (whichever exist)."""
    model, _ = load_model(probe, cfg, device, resolve_dtype(cfg.dtype, device))
    tokenizer, no_text = load_part("text", probe, cfg)
    extractor, no_audio = load_part("audio", probe, cfg)
    max_length = None
    if tokenizer is not None:
        max_length = text_limit(tokenizer, getattr(probe.config, "text_config", probe.config), None, cfg.max_length)
    unavailable = {k: v for k, v in (("text", no_text), ("audio", no_audio)) if v}
    return ClapEncoder(probe, cfg, device, model, tokenizer=tokenizer, max_length=max_length,
                       audio=None if extractor is None else ExtractorAudio(extractor),
                       default_normalize=True, pooling="projection", unavailable=unavailable)
