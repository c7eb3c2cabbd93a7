"""Audio and video payloads in the encoder: audio features into a device batch, a video clip's
embedding as the mean of its sampled frames' image embeddings, and its per-frame embeddings
(`FramesEncoder`, `--pooling frames`).

The mean is taken of the frames' raw embeddings; the run normalizes it afterwards when
normalizing is on (so a clip's vector is the normalized mean, not the mean of normalized frames).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import ModelLoadError
from .base import AudioInput, EncodeOutput, Encoder, ImageInput, ImagePreprocessor, VideoInput
from .device import to_device

if TYPE_CHECKING:  # pragma: no cover
    import torch


def frames_of_clips(encode_images: Callable[[list[ImageInput]], EncodeOutput],
                    payloads: Sequence[VideoInput]) -> list["torch.Tensor"]:
    """Each clip's `[frames, dim]` float32 embeddings: the frames of all clips encoded as one image batch."""
    import torch

    vectors = encode_images([frame for clip in payloads for frame in clip.frames]).vectors
    if not isinstance(vectors, torch.Tensor):  # token-level outputs have no vector per frame
        raise ValueError("video clips need a pooled image encoder (one vector per frame)")
    return [part.float() for part in torch.split(vectors, [len(clip.frames) for clip in payloads])]


def mean_of_frames(encode_images: Callable[[list[ImageInput]], EncodeOutput],
                   payloads: Sequence[VideoInput]) -> EncodeOutput:
    """One vector per clip: the mean of its frames' embeddings (float32)."""
    import torch

    return EncodeOutput(torch.stack([part.mean(dim=0) for part in frames_of_clips(encode_images, payloads)]))


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


class FramesEncoder(Encoder):
    """`--pooling frames`: a pooled image model's per-frame embeddings of each video clip, one
    `[frames, dim]` tensor per clip (written as token shards with an index). Wraps the model's
    own adapter (loaded with `--pooling auto`); rows are normalized when normalizing is on."""

    output_kind = "tokens"
    normalizes_rows = True

    def __init__(self, inner: Encoder) -> None:
        if "video" not in inner.modalities or inner.video_preprocessor() is not None:
            raise ModelLoadError(f"--pooling frames needs a pooled image model (CLIP, SigLIP, ViT, OpenCLIP, "
                                 f"timm); {inner.info.get('model')} encodes video its own way: use its poolings")
        self.inner = inner
        self.modalities = frozenset({"video"})
        self.dim, self.default_normalize, self.device = inner.dim, inner.default_normalize, inner.device
        self.info = {**inner.info, "pooling": "frames"}

    def image_preprocessor(self) -> ImagePreprocessor:
        return self.inner.image_preprocessor()

    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        """One float32 `[frames, dim]` tensor per clip (its frames encoded as one image batch)."""
        if modality != "video":
            raise ValueError(f"--pooling frames encodes video clips only, not {modality!r}")
        return EncodeOutput(frames_of_clips(lambda frames: self.inner.encode("image", frames), payloads))

    def device_seconds(self) -> float | None:
        return self.inner.device_seconds()

    def forward_summary(self) -> dict[str, Any] | None:
        return self.inner.forward_summary()
