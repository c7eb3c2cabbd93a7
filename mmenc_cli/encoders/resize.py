"""Resizing a decoded image to uint8 CHW: Pillow's own resize (`--decode exact`, the processor's
pixels bit for bit) or, under `--decode fast`, torch's antialiased uint8 kernels.

torch's antialiased bilinear and bicubic (`interpolate(..., antialias=True)` on a channels-last
uint8 tensor) implement Pillow's filters (support scaled by the reduction, Catmull-Rom a = -0.5)
with SIMD: several times faster on one core, and within one level of Pillow's pixels nearly
everywhere. Other filters (Lanczos, box, nearest, Hamming), and a torch without these kernels,
take Pillow's path. A worker that uses it imports torch (one thread per worker, `init_worker`).

`box` is the part of the image to resize, in its pixels: a JPEG decoded at a reduced scale is
rounded up to whole pixels, so the full image covers (0, 0, 185.25, 125.0) of a 186x125 one;
resizing that box, not all of it, keeps the geometry of the full decode.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

#: Pillow's filter ids that torch's antialiased kernels reproduce: BILINEAR, BICUBIC
TORCH_FILTERS = {2: "bilinear", 3: "bicubic"}

Box = tuple[float, float, float, float]


def resized_chw(image: "Image.Image", height: int, width: int, resample: int, fast: bool,
                box: Box | None = None) -> np.ndarray:
    """An RGB image (its `box`) as uint8 [3, height, width] (a view: make it contiguous after cropping)."""
    if box == (0, 0, image.width, image.height):
        box = None
    if fast and resample in TORCH_FILTERS:
        try:
            out = _torch_resize(image, height, width, TORCH_FILTERS[resample], box)
        except (RuntimeError, NotImplementedError):  # an old torch without uint8 antialiasing
            out = None
        if out is not None:
            return out
    return np.asarray(image.resize((width, height), resample=resample, box=box), dtype=np.uint8).transpose(2, 0, 1)


def _torch_resize(image: "Image.Image", height: int, width: int, mode: str, box: Box | None) -> np.ndarray | None:
    import torch
    from torch.nn.functional import interpolate

    with warnings.catch_warnings():  # Pillow's buffer is read-only; torch only reads it here
        warnings.simplefilter("ignore", UserWarning)
        hwc = torch.from_numpy(np.asarray(image, dtype=np.uint8))
    x = hwc.permute(2, 0, 1)[None]  # [1, 3, H, W] over HWC memory: the channels-last layout of the SIMD kernels
    if box is None:
        return interpolate(x, size=(height, width), mode=mode, antialias=True)[0].numpy()
    # A box from 0 is a scale: the output's pixel centres map to (i + 0.5) / scale, as Pillow's box
    # does. A box ending at the far side (an EXIF flip moved the partial pixels there) is one from 0
    # of the flipped image.
    flips = [dim for dim, start in ((3, box[0]), (2, box[1])) if start > 0]
    x = torch.flip(x, flips) if flips else x
    scale = (height / (box[3] - box[1]), width / (box[2] - box[0]))
    out = interpolate(x, scale_factor=scale, mode=mode, antialias=True, recompute_scale_factor=False)
    if tuple(out.shape[-2:]) != (height, width):
        return None
    return (torch.flip(out, flips) if flips else out)[0].numpy()
