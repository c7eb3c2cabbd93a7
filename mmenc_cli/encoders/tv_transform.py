"""Image input for models whose library preprocesses with a torchvision transform (OpenCLIP, timm).

Their evaluation transforms are mostly `Resize` (shortest edge, or a fixed size) -> `CenterCrop`
-> RGB -> `ToTensor` -> `Normalize`. Such a transform splits like a transformers processor does
(`preprocess.py`): the workers resize and crop with PIL (what torchvision does to a PIL image) and
ship uint8 pixels, and the encoder maps each value through a table holding torchvision's own
float32 arithmetic (`value / 255`, then `(x - mean) / std`), so the result is the library's, bit
for bit. Any other transform (OpenCLIP's keep-ratio resize for non-square sizes, pads, crops of
other kinds) runs whole in the worker (`TransformPreprocessor`, float32 out; its workers import
torch). Images reach preprocessing already RGB (the decode step converts them), so the
transform's own RGB conversion has nothing left to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .base import ImageInput, ImagePreprocessor
from .preprocess import PixelPreprocessor, to_rgb

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

    from .torch_encoder import ImagePlan

#: steps that convert to RGB (OpenCLIP's `MaybeConvertMode`, `_convert_to_rgb`): no-ops on RGB input
_RGB_STEPS = ("MaybeConvertMode", "_convert_to_rgb", "convert_to_rgb", "ToRGB")


@dataclass(frozen=True)
class TransformPreprocessor(ImagePreprocessor):
    """The library's whole transform, run in the worker: float32 CHW model input."""

    transform: Any

    def __call__(self, image: "Image.Image") -> ImageInput:
        pixels = self.transform(to_rgb(image))
        return ImageInput(np.ascontiguousarray(pixels.numpy(), dtype=np.float32))


def tensor_table(mean: Any, std: Any) -> np.ndarray:
    """float32 [3, 256]: torchvision's `to_tensor` (value / 255 in float32) then `normalize`
    (`(x - mean) / std` in float32) of each uint8 value, per channel."""
    x = np.broadcast_to(np.arange(256, dtype=np.float32) / np.float32(255), (3, 256))
    mean = np.broadcast_to(np.asarray(mean, dtype=np.float32).reshape(-1), (3,))
    std = np.broadcast_to(np.asarray(std, dtype=np.float32).reshape(-1), (3,))
    return np.ascontiguousarray(((x.T - mean) / std).T, dtype=np.float32)


def plan_transform(transform: Any) -> "ImagePlan":
    """The uint8 split of a standard torchvision evaluation transform, else the whole transform
    in the worker (`(TransformPreprocessor, None)`)."""
    split = _split(list(getattr(transform, "transforms", [transform])))
    return split if split is not None else (TransformPreprocessor(transform), None)


def _split(steps: list[Any]) -> "ImagePlan | None":
    from torchvision import transforms as T
    from torchvision.transforms.functional import pil_modes_mapping

    size = edge = crop = None
    resample = 2
    if steps and type(steps[0]) is T.Resize:
        resize = steps.pop(0)
        if resize.max_size is not None or resize.interpolation not in pil_modes_mapping:
            return None
        resample = int(pil_modes_mapping[resize.interpolation])
        dims = [resize.size] if isinstance(resize.size, int) else list(resize.size)
        if len(dims) == 1:
            edge = int(dims[0])
        else:
            size = (int(dims[0]), int(dims[1]))
    if steps and type(steps[0]) is T.CenterCrop:
        crop = tuple(int(v) for v in steps.pop(0).size)
    while steps and _name(steps[0]) in _RGB_STEPS:
        steps.pop(0)
    if not (len(steps) == 2 and isinstance(steps[0], T.ToTensor) and type(steps[1]) is T.Normalize):
        return None
    norm = steps[1]
    return PixelPreprocessor(size, edge, crop, resample, rounded_crop=True), tensor_table(norm.mean, norm.std)


def _name(step: Any) -> str:
    mode = getattr(step, "mode", "RGB")
    return getattr(step, "__name__", type(step).__name__) if mode == "RGB" else ""
