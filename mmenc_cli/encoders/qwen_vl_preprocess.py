"""Qwen2-VL / Qwen2.5-VL image preprocessing in the decode workers: uint8 patches and their grids.

Images cross processes as uint8 patches (`QwenPatchPreprocessor`, torch-free): RGB ->
`smart_resize` (the processor's own rule) -> PIL resize -> patches laid out exactly as the
processor flattens them, but before rescale/normalize and without the temporal copy; the encoder
normalizes them on the device (`qwen_vl.py`). Processors this module cannot reproduce fall back to
running the processor in the worker (`QwenProcessorPreprocessor`, float32 patches). Per image the
worker also records `meta`: `image_grid_thw` (t, h, w), `tokens` = t*h*w / merge_size^2,
`orig_size` (w, h), `min_pixels`, `max_pixels`.

Video clips (`QwenVideoPreprocessor`): the frames mmenc sampled go through the model's own video
processor in the worker (temporal patches of `temporal_patch_size` frames, the last frame repeated
to fill the last patch), float32 patches with `video_grid_thw` in `meta`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import MMError, ModelLoadError
from .base import ImageInput, ImagePreprocessor
from .preprocess import normalization_table, to_rgb

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

log = logging.getLogger("mmenc")

MAX_ASPECT = 200  # the processor refuses more extreme aspect ratios


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the pixel count in [min, max]:
    the same arithmetic as transformers' `qwen2_vl` `smart_resize`."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(pixels: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """CHW pixels -> `[grid_h * grid_w, C * patch * patch]` in the processor's patch order
    (merge windows contiguous), without its temporal copy."""
    c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    return np.ascontiguousarray(x.reshape(gh * gw, c * patch * patch))


@dataclass(frozen=True)
class QwenPatchPreprocessor(ImagePreprocessor):
    """Worker side: RGB -> smart resize -> uint8 patches `[h*w, C*p*p]` + grid meta. Torch-free."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    resample: int

    def __call__(self, image: "Image.Image") -> ImageInput:
        image = to_rgb(image)
        width, height = image.size
        try:
            new_h, new_w = smart_resize(height, width, self.patch_size * self.merge_size,
                                        self.min_pixels, self.max_pixels)
        except ValueError as exc:  # the input's shape, not our failure
            raise MMError(str(exc), stage="preprocess", reason="preprocess.unsupported_shape",
                          error="ValueError") from None
        if (new_h, new_w) != (height, width):
            image = image.resize((new_w, new_h), resample=self.resample)
        pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        patches = patchify(pixels, self.patch_size, self.merge_size)
        grid = (1, new_h // self.patch_size, new_w // self.patch_size)
        return ImageInput(patches, self.meta(grid, (width, height)))

    def meta(self, grid: tuple[int, int, int], orig_size: tuple[int, int]) -> dict[str, Any]:
        """The per-image facts the encoder checks and the writer indexes."""
        t, h, w = grid
        return {"image_grid_thw": (int(t), int(h), int(w)), "tokens": int(t * h * w) // self.merge_size ** 2,
                "orig_size": (int(orig_size[0]), int(orig_size[1])),
                "min_pixels": int(self.min_pixels), "max_pixels": int(self.max_pixels)}


@dataclass(frozen=True)
class QwenProcessorPreprocessor(ImagePreprocessor):
    """Fallback: the model's own image processor in the worker; float32 patches `[h*w, C*T*p*p]`.

    Unpickling it imports transformers (and torch) in the worker; used only for processors the
    uint8 path cannot reproduce (subclasses, remote code, no resizing).
    """

    processor: Any
    plan: QwenPatchPreprocessor

    def __call__(self, image: "Image.Image") -> ImageInput:
        out = self.processor(images=[image], return_tensors="np")
        grids = np.asarray(out["image_grid_thw"]).reshape(-1, 3)
        if len(grids) != 1:
            raise MMError(f"the image processor produced {len(grids)} grids for one image",
                          stage="preprocess", reason="preprocess.failed")
        patches = np.asarray(out["pixel_values"], dtype=np.float32)
        grid = (int(grids[0][0]), int(grids[0][1]), int(grids[0][2]))
        return ImageInput(patches, self.plan.meta(grid, image.size))


@dataclass(frozen=True)
class QwenVideoPreprocessor:
    """Worker side: a clip's sampled frames -> the video processor's float32 patches `[t*h*w,
    C*T*p*p]` + `video_grid_thw`. Unpickling it imports transformers (and torch) in the worker."""

    processor: Any
    merge_size: int

    def __call__(self, frames: "list[Image.Image]") -> ImageInput:
        out = self.processor(videos=[[to_rgb(f) for f in frames]], return_tensors="np", do_sample_frames=False)
        grids = np.asarray(out["video_grid_thw"]).reshape(-1, 3)
        if len(grids) != 1:
            raise MMError(f"the video processor produced {len(grids)} grids for one clip",
                          stage="preprocess", reason="preprocess.failed")
        t, h, w = (int(x) for x in grids[0])
        meta = {"video_grid_thw": (t, h, w), "tokens": t * h * w // self.merge_size ** 2,
                "orig_size": tuple(int(x) for x in frames[0].size), "frames": len(frames)}
        return ImageInput(np.asarray(out["pixel_values_videos"], dtype=np.float32), meta)


def plan_preprocessor(processor: Any, vision_config: Any) -> tuple[Any, np.ndarray | None]:
    """The worker preprocessor for this image processor, and the normalization table (uint8 path).

    Raises `ModelLoadError` when the processor's patching disagrees with the vision tower's.
    """
    size = getattr(processor, "size", None)
    min_pixels = getattr(size, "shortest_edge", None) or getattr(size, "min_pixels", None)
    max_pixels = getattr(size, "longest_edge", None) or getattr(size, "max_pixels", None)
    patch = int(getattr(processor, "patch_size", 14))
    merge = int(getattr(processor, "merge_size", 2))
    temporal = int(getattr(processor, "temporal_patch_size", 2))
    for name, ours in (("patch_size", patch), ("spatial_merge_size", merge), ("temporal_patch_size", temporal)):
        theirs = getattr(vision_config, name, ours)
        if int(theirs) != ours:
            raise ModelLoadError(f"image processor {name} {ours} differs from the vision tower's {theirs}")
    if not (min_pixels and max_pixels):
        raise ModelLoadError("the image processor has no min/max pixels (size.shortest_edge/longest_edge)")
    resample = 3 if processor.resample is None else int(processor.resample)  # Qwen's default: bicubic
    plan = QwenPatchPreprocessor(patch, merge, temporal, int(min_pixels), int(max_pixels), resample)
    if not _reproducible(processor):
        log.info("%s: image processor not reproducible in workers; running it there (float32 patches)",
                 type(processor).__name__)
        return QwenProcessorPreprocessor(processor, plan), None
    table = normalization_table(bool(processor.do_rescale), float(processor.rescale_factor or 1.0),
                                bool(processor.do_normalize), processor.image_mean, processor.image_std)
    return plan, table


def _reproducible(processor: Any) -> bool:
    """True for transformers' own PIL Qwen2-VL processor, unmodified, resizing and converting to RGB."""
    try:
        from transformers.image_processing_backends import PilBackend
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Ref
    except ImportError:  # pragma: no cover - other transformers layouts
        return False
    cls = type(processor)
    same = all(getattr(cls, m, None) is getattr(Ref, m, None) for m in
               ("preprocess", "_preprocess", "resize", "patchify", "rescale", "normalize", "convert_to_rgb",
                "process_image", "_standardize_kwargs"))
    mean = np.asarray(getattr(processor, "image_mean", 0.0) or 0.0)
    return (isinstance(processor, PilBackend) and same and bool(processor.do_resize)
            and getattr(processor, "do_convert_rgb", True) is not False and mean.size in (1, 3))
