"""`--decode gpu`: JPEGs decoded on the model's device (nvJPEG on CUDA), then resized and cropped
there as the uint8 worker path does on the CPU.

The decoder is torchvision's `decode_jpeg` (the `mmenc[gpu]` extra; nvJPEG on CUDA, batched).
torchvision 0.29 deprecates its image decoders in favour of TorchCodec's, which this module does
not use yet: only `jpeg_decoder` would change. On a CPU device the same code runs with
torchvision's CPU decoder, which is how the tests prove the path without a GPU.
A batch's JPEGs are decoded in one call; when that call fails, each is decoded alone and the ones
the decoder refuses come back as None, for the CPU workers to decode (a corrupt JPEG then becomes
its one error row there); so does an image whose resize fails (out of memory on a huge one). A
sticky device error raises `DeviceError`: it is the device's, no image's.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import DeviceError, ModelLoadError, is_device_fault
from .base import ImageInput
from .device import on_side_stream
from .preprocess import PixelPreprocessor, center_crop, center_crop_rounded, shortest_edge_size

if TYPE_CHECKING:  # pragma: no cover
    import torch

EXTRA = "pip install 'mmenc[gpu]'"

#: PIL resampling ids -> torchvision's interpolation names (tensors have no Lanczos, box or Hamming:
#: bicubic stands in for them)
_INTERPOLATION = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def jpeg_decoder() -> Callable[..., Any]:
    """`decode(list_of_uint8_tensors, device)` -> list of CHW uint8 RGB tensors; ModelLoadError
    naming the extra when no library offers one."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as exc:
        raise ModelLoadError(f"--decode gpu needs torchvision's JPEG decoder ({type(exc).__name__}: {exc}); "
                             f"install it with: {EXTRA}") from None

    def decode(data: list["torch.Tensor"], device: str) -> list["torch.Tensor"]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            out = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        return list(out)

    return decode


class DeviceJpegDecoder:
    """Decodes a batch's JPEG payloads on `device` and applies `prep`'s resize and crop there."""

    def __init__(self, prep: PixelPreprocessor, device: str) -> None:
        self.prep, self.device = prep, device
        self.decode = jpeg_decoder()

    def __call__(self, payloads: list[ImageInput]) -> list[ImageInput | None]:
        import torch

        out: list[ImageInput | None] = list(payloads)
        jpegs = [i for i, p in enumerate(payloads) if p.meta.get("jpeg")]
        if not jpegs:
            return out
        data = [torch.from_numpy(_writable(payloads[i].pixels)) for i in jpegs]
        for i, image in zip(jpegs, self._on_side_stream(lambda: self._decode_all(data))):
            out[i] = None if image is None else self._preprocessed(image)
        return out

    def _decode_all(self, data: list["torch.Tensor"]) -> list["torch.Tensor | None"]:
        """All in one call; after a failure, one by one (None where refused)."""
        try:
            return self.decode(data, self.device)
        except Exception as exc:
            _raise_device_fault(exc)
        images: list[torch.Tensor | None] = []
        for one in data:
            try:
                images.append(self.decode([one], self.device)[0])
            except Exception as exc:
                _raise_device_fault(exc)
                images.append(None)
        return images

    def _on_side_stream(self, decode: Callable[[], list[Any]]) -> list[Any]:
        """Run `decode` on the device's side stream (`device.on_side_stream`): nvJPEG writes its
        outputs from torchvision's own streams without waiting for the current one, whose queued
        kernels (the previous batch's forward, still running) may use memory the allocator already
        handed to those outputs; on the side stream they get only memory that stream is done with."""
        if not self.device.startswith("cuda"):
            return decode()
        return on_side_stream(self.device, decode)

    def _preprocessed(self, image: "torch.Tensor") -> ImageInput | None:
        """The image resized and cropped; None (decoded on the CPU instead) when that fails, e.g.
        out of memory on a huge one; a sticky device error raises `DeviceError`."""
        try:
            return ImageInput(self.preprocess(image))
        except Exception as exc:
            _raise_device_fault(exc)
            return None

    def preprocess(self, image: "torch.Tensor") -> "torch.Tensor":
        """Resize (antialiased) and center-crop a CHW uint8 image as `prep` does on the CPU."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional as F

        prep, (_, h, w) = self.prep, image.shape
        target = prep.size if prep.shortest_edge is None else shortest_edge_size(h, w, prep.shortest_edge)
        if target is not None and tuple(target) != (h, w):
            mode = InterpolationMode(_INTERPOLATION.get(prep.resample, "bicubic"))
            image = F.resize(image, list(target), interpolation=mode, antialias=True)
        if prep.crop is not None:
            image = (center_crop_rounded if prep.rounded_crop else center_crop)(image, *prep.crop)
        return image.contiguous()


def _raise_device_fault(exc: BaseException) -> None:
    """A sticky CUDA error is the device's, no image's: the run ends (`DeviceError`, exit 1)."""
    if is_device_fault(exc):
        raise DeviceError.of(exc, " while decoding JPEGs") from None


def _writable(data: np.ndarray) -> np.ndarray:
    """torch wants writable memory: a shared-memory slot is; bytes from a pickle are copied."""
    return data if data.flags.writeable else data.copy()
