"""Audio and video payloads in the encoder: audio features into a device batch, and a video
clip's embedding as the mean of its sampled frames' image embeddings.

The mean is taken of the frames' raw embeddings; the run normalizes it afterwards when
normalizing is on (so a clip's vector is the normalized mean, not the mean of normalized frames).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .base import AudioInput, EncodeOutput, ImageInput, VideoInput
from .device import to_device

if TYPE_CHECKING:  # pragma: no cover
    import torch


def mean_of_frames(encode_images: Callable[[list[ImageInput]], EncodeOutput],
                   payloads: Sequence[VideoInput]) -> EncodeOutput:
    """One vector per clip: its frames encoded as one image batch, averaged per clip (float32)."""
    import torch

    frames = [frame for clip in payloads for frame in clip.frames]
    vectors = encode_images(frames).vectors
    if not isinstance(vectors, torch.Tensor):  # token-level outputs have no mean of frames here
        raise ValueError("video clips need a pooled image encoder (one vector per frame)")
    counts = [len(clip.frames) for clip in payloads]
    return EncodeOutput(torch.stack([part.float().mean(dim=0) for part in torch.split(vectors, counts)]))


def collate_audio(payloads: Sequence[AudioInput], device: str, dtype: "torch.dtype") -> dict[str, "torch.Tensor"]:
    """Stack the clips' feature arrays along a new batch axis, on the device; floating features
    in the model's dtype, the others (CLAP's `is_longer` flags) as they are."""
    import torch

    out: dict[str, Any] = {}
    for key in payloads[0].features:
        stacked = torch.from_numpy(np.stack([p.features[key] for p in payloads]))
        tensor = to_device(stacked, device)
        out[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return out
