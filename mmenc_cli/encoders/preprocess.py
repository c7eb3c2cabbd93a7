"""Image preprocessing split between worker processes and the encode loop (device).

Most vision processors (CLIP, SigLIP, ViT, DINOv2's BiT processor, ...) run
convert RGB -> resize -> center crop -> rescale -> normalize. Resize and crop produce uint8 pixels,
so workers do only those two steps (`PixelPreprocessor`, PIL + numpy, no transformers; torch only
for `--decode fast`'s resize, `resize.py`) and ship compact uint8 CHW arrays; the encoder maps
uint8 to normalized float32 on the device with a 3 x 256 lookup table (`normalization_table`). The
table is computed with the same numpy float32 operations as transformers' PIL processor, so the
split path under `--decode exact` reproduces the processor's `pixel_values` bit for bit.

Processors that do anything else (patching, padding, dynamic resolution, remote code) fall back to
`ProcessorPreprocessor`: the whole processor runs in the worker and ships float32 model inputs.
Unpickling that one imports transformers (and so torch) in the worker; the uint8 path does not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .base import REDUCED, ImageInput, ImagePreprocessor
from .resize import TORCH_FILTERS, resized_chw

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

# PilBackend methods a processor must not override for its pipeline to be the standard one.
_STANDARD_METHODS = ("preprocess", "_preprocess", "_preprocess_image_like_inputs",
                     "_prepare_image_like_inputs", "_prepare_images_structure", "process_image",
                     "convert_to_rgb", "resize", "center_crop", "rescale", "normalize",
                     "_standardize_kwargs")


def to_rgb(image: "Image.Image") -> "Image.Image":
    """RGB as transformers' `convert_to_rgb` does it: transparent pixels become white, not black."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
    """(height, width) after scaling the shorter side to `edge` (transformers' integer rounding)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(edge * long / short)
    return (new_long, edge) if width <= height else (edge, new_long)


def _zeros(like: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of `like`'s kind and dtype: a numpy array, or a torch tensor on its device."""
    return like.new_zeros(shape) if hasattr(like, "new_zeros") else np.zeros(shape, dtype=like.dtype)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Center-crop a CHW array (or tensor), zero-padding first where it is smaller (transformers'
    semantics)."""
    _, h, w = pixels.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    pad_top, pad_left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)  # ceil
    padded = _zeros(pixels, (pixels.shape[0], new_h, new_w))
    padded[:, pad_top:pad_top + h, pad_left:pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


def center_crop_rounded(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Center-crop a CHW array as torchvision's `center_crop` does it (OpenCLIP, timm): zero-pad
    where it is smaller (left/top get the floor half), offsets rounded half to even."""
    _, h, w = pixels.shape
    if width > w or height > h:
        top, left = max(height - h, 0) // 2, max(width - w, 0) // 2
        padded = _zeros(pixels, (pixels.shape[0], max(height, h), max(width, w)))
        padded[:, top:top + h, left:left + w] = pixels
        pixels, (_, h, w) = padded, padded.shape
    top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return pixels[:, top:top + height, left:left + width]


@dataclass(frozen=True)
class PixelPreprocessor(ImagePreprocessor):
    """Worker side of the uint8 path: RGB -> resize -> center crop -> uint8 CHW `ImageInput`.

    Exactly one of `size` (fixed height, width) and `shortest_edge` is set when resizing; `crop`
    is (height, width) or None, cut as transformers does (`rounded_crop` False) or as torchvision
    does (True); `resample` is a PIL resampling filter id.
    """

    size: tuple[int, int] | None
    shortest_edge: int | None
    crop: tuple[int, int] | None
    resample: int
    rounded_crop: bool = False
    fast: bool = False  # resize with torch's antialiased uint8 kernels (`--decode fast`)

    def for_fast_decode(self) -> "PixelPreprocessor":
        return replace(self, fast=True)

    def imports_torch(self) -> bool:
        return self.fast and self.resample in TORCH_FILTERS

    def draft_size(self, width: int, height: int) -> tuple[int, int] | None:
        """(width, height) to ask a JPEG decoder for: twice what the resize needs, when the image is
        at least four times that on both sides; else None. A reduced DCT scale is a blockwise box
        filter: the resize after it keeps at least a factor of 2 to antialias, which keeps the
        pixels close to a full decode's (at a factor near 1, fine detail aliases)."""
        target = self.size
        if self.shortest_edge is not None:
            target = shortest_edge_size(height, width, self.shortest_edge)
        if target is None or width < 4 * target[1] or height < 4 * target[0]:
            return None
        return 2 * target[1], 2 * target[0]

    def max_pixel_bytes(self) -> int | None:
        """3 x crop (or fixed size) bytes; None when only the shortest edge is fixed."""
        fixed = self.crop or self.size
        return None if fixed is None else 3 * fixed[0] * fixed[1]

    def __call__(self, image: "Image.Image") -> ImageInput:
        full, box = image.info.get(REDUCED) or (image.size, None)  # reduced: the full image's shape decides
        image = to_rgb(image)
        target = self.size
        if self.shortest_edge is not None:
            target = shortest_edge_size(full[1], full[0], self.shortest_edge)
        if target is not None and target != (image.height, image.width):
            pixels = resized_chw(image, *target, self.resample, self.fast, box)
        else:
            pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        if self.crop is not None:
            pixels = (center_crop_rounded if self.rounded_crop else center_crop)(pixels, *self.crop)
        return ImageInput(np.ascontiguousarray(pixels))


@dataclass(frozen=True)
class ProcessorPreprocessor(ImagePreprocessor):
    """Fallback: run the model's whole image processor in the worker and ship its float32 output.

    Extra model inputs the processor makes (e.g. SigLIP 2's `pixel_attention_mask`,
    `spatial_shapes`) travel in `meta["inputs"]`.
    """

    processor: Any

    def __call__(self, image: "Image.Image") -> ImageInput:
        out = self.processor(images=[image], return_tensors="np")
        extra = {k: np.asarray(v[0]) for k, v in out.items() if k != "pixel_values"}
        pixels = np.asarray(out["pixel_values"][0], dtype=np.float32)
        return ImageInput(pixels, {"inputs": extra} if extra else {})


def normalization_table(do_rescale: bool, rescale_factor: float, do_normalize: bool,
                        mean: Any, std: Any) -> np.ndarray:
    """float32 [3, 256]: what the processor's rescale + normalize make of each uint8 value, per channel.

    Same numpy operations and dtypes as transformers (rescale in float64 then cast to float32;
    normalize in float32), so indexing this table is exact.
    """
    x = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 256))
    x = (x.astype(np.float64) * rescale_factor).astype(np.float32) if do_rescale else x.astype(np.float32)
    if do_normalize:
        mean = np.broadcast_to(np.asarray(mean, dtype=np.float32), (3,))
        std = np.broadcast_to(np.asarray(std, dtype=np.float32), (3,))
        x = ((x.T - mean) / std).T
    return np.ascontiguousarray(x, dtype=np.float32)


def plan_image_input(processor: Any) -> tuple[ImagePreprocessor, np.ndarray | None]:
    """Choose how images cross processes for this transformers image processor.

    Returns `(PixelPreprocessor, table)` when the processor is a standard PIL-backend pipeline we
    can split, else `(ProcessorPreprocessor, None)`. Runs in the main process (imports transformers).
    """
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:  # pragma: no cover - older transformers: no backend split to rely on
        return ProcessorPreprocessor(processor), None
    cls = type(processor)
    standard = isinstance(processor, PilBackend) and all(
        getattr(cls, name, None) is getattr(PilBackend, name, None) for name in _STANDARD_METHODS)
    size, crop = getattr(processor, "size", None), getattr(processor, "crop_size", None)
    mean = np.asarray(getattr(processor, "image_mean", 0.0) or 0.0)
    if not standard or getattr(processor, "do_pad", False) or mean.size not in (1, 3):
        return ProcessorPreprocessor(processor), None

    fixed = edge = None
    if processor.do_resize:
        others = [getattr(size, k, None) for k in ("longest_edge", "max_height", "max_width",
                                                   "min_pixels", "max_pixels")]
        if any(v is not None for v in others):
            return ProcessorPreprocessor(processor), None
        if size.shortest_edge:
            edge = int(size.shortest_edge)
        elif size.height and size.width:
            fixed = (int(size.height), int(size.width))
        else:
            return ProcessorPreprocessor(processor), None
    crop_hw = None
    if processor.do_center_crop:
        if not (crop is not None and crop.height and crop.width):
            return ProcessorPreprocessor(processor), None
        crop_hw = (int(crop.height), int(crop.width))
    resample = 2 if processor.resample is None else int(processor.resample)  # PIL default: bilinear
    table = normalization_table(bool(processor.do_rescale), float(processor.rescale_factor or 1.0),
                                bool(processor.do_normalize), processor.image_mean, processor.image_std)
    return PixelPreprocessor(fixed, edge, crop_hw, resample), table
