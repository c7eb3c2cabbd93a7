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
from .clip import DualTowerEncoder, load_towers
from .hf import HFEncoder
from .loading import ModelProbe

if TYPE_CHECKING:  # pragma: no cover
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


class ClapEncoder(DualTowerEncoder):
    """CLAP: `get_audio_features` / `get_text_features` (projected, pooled)."""

    family = "clap"
    towers = frozenset({"audio", "text"})


def load(probe: ModelProbe, cfg: "ModelConfig", device: str) -> HFEncoder:
    """Load a CLAP model with its tokenizer and feature extractor (whichever exist)."""
    model, tokenizer, extractor, text = load_towers(probe, cfg, device, "audio")
    return ClapEncoder(probe, cfg, device, model, tokenizer=tokenizer,
                       audio=None if extractor is None else ExtractorAudio(extractor),
                       default_normalize=True, pooling="projection", **text)
