"""The small interface every model adapter implements, and what crosses process boundaries.

The pipeline never sees model internals. Per modality it needs:

* for images, a picklable `ImagePreprocessor` that turns a decoded RGB PIL image into a compact
  `ImageInput` inside a worker process (uint8 pixels where the processor allows), and
* an `Encoder.encode(modality, payloads)` that takes a list of `ImageInput` (images) or `str`
  (texts, prefix already applied) and returns one float32 vector per payload (pooled modes) or
  one `[tokens, dim]` tensor per payload (`--pooling tokens`).

`encode` is called on any sub-list of a batch: the batching stage bisects failed batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from PIL import Image


@dataclass(slots=True)
class ImageInput:
    """What a worker ships to the encode loop for one image.

    `pixels` is uint8 (resized/cropped, not yet rescaled or normalized) where the model's
    processor allows it, else float32 model input. `meta` carries per-image facts the encoder or
    the writer needs (e.g. `image_grid_thw`, `orig_size`).
    """

    pixels: "np.ndarray"
    meta: dict[str, Any] = field(default_factory=dict)


class ImagePreprocessor(Protocol):
    """Runs in worker processes: RGB PIL image -> `ImageInput`. Must be picklable, torch-free."""

    def __call__(self, image: "Image.Image") -> ImageInput: ...


@dataclass(slots=True)
class EncodeOutput:
    """The result of encoding one sub-batch.

    `vectors`: float32 tensor `[n, dim]` (pooled), or a list of `[tokens_i, dim]` tensors (tokens).
    `truncated`: per text, whether tokenization cut it (empty for images).
    """

    vectors: "torch.Tensor | list[torch.Tensor]"
    truncated: list[bool] = field(default_factory=list)


class Encoder(Protocol):
    """A loaded model adapter. Loaded once per run (per device)."""

    #: modalities this model can encode: a subset of {"image", "text"}
    modalities: frozenset[str]
    #: embedding dimension
    dim: int
    #: the model's own convention for normalizing (ST `Normalize` module, CLIP/SigLIP: True)
    default_normalize: bool
    #: facts recorded in the run metadata: model id, resolved revision, family, pooling, max_length...
    info: dict[str, Any]
    #: "pooled" (one vector per item) or "tokens" (one [tokens, dim] tensor per item)
    output_kind: str

    def image_preprocessor(self) -> ImagePreprocessor:
        """A picklable callable for worker processes."""
        ...

    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        """Encode a non-empty list of payloads of one modality under `torch.inference_mode()`."""
        ...
