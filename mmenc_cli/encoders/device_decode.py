"""`--decode gpu`: JPEGs decoded on the model's device (nvJPEG on CUDA), then resized and cropped
there as the uint8 worker path does on the CPU, one batch ahead of the forward.

The decoder is torchvision's `decode_jpeg` (the `mmenc[gpu]` extra; nvJPEG on CUDA, batched).
torchvision 0.29 deprecates its image decoders in favour of TorchCodec's, which this module does
not use yet: only `jpeg_decoder` would change. On a CPU device the same code runs with
torchvision's CPU decoder, which is how the tests prove the path without a GPU.

torchvision's CUDA decode returns only once its stream is done (it synchronizes the host), and the
host side of nvJPEG (parsing, Huffman decoding of what the hardware decoder does not take) runs on
the calling thread; so a batch is decoded on a thread of its own, on a CUDA stream of its own,
while the encode thread launches the previous batch's forward. The encode thread's stream then
waits for an event recorded after the batch's last kernel, not for everything queued on the decode
stream since (the next batch's decode may already be there).

A batch's JPEGs are decoded in one call; when that call fails, each half is tried again, down to
single images, and the ones the decoder refuses come back as None, for the CPU workers to decode
(a corrupt JPEG then becomes its one error row there). Images of one size are resized in one call.
A group whose resize fails is resized image by image; an image whose resize fails (out of memory
on a huge one) goes back to the workers too. A sticky device error raises `DeviceError`: it is the
device's, no image's. nvJPEG reports a CUDA error as its number ("Failed to synchronize CUDA
stream: 700"), and some as a status of its own: after any failed call the decode stream is
synchronized, which raises the context's sticky error if there is one.
"""

from __future__ import annotations

import re
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ..errors import DeviceError, ModelLoadError, is_device_fault
from .base import DecodeAhead, DeviceDecoder, ImageInput
from .device import side_stream
from .preprocess import PixelPreprocessor, center_crop, center_crop_rounded, shortest_edge_size

if TYPE_CHECKING:  # pragma: no cover
    import torch

EXTRA = "pip install 'mmenc[gpu]'"

#: PIL resampling ids -> torchvision's interpolation names (tensors have no Lanczos, box or Hamming:
#: bicubic stands in for them)
_INTERPOLATION = {0: "nearest", 2: "bilinear", 3: "bicubic"}

#: cudaError_t numbers after which the context is lost (illegal address, launch timeout, assert,
#: hardware stack error, illegal instruction, misaligned address, invalid address space, invalid
#: PC, launch failure; 214: uncorrectable ECC error), as nvJPEG's messages through torchvision give them
STICKY_CUDA_STATUS = frozenset({214, 700, 702, 710, 714, 715, 716, 717, 718, 719})
_CUDA_STATUS = re.compile(r"cuda stream: (\d+)", re.IGNORECASE)

#: the most pixels resized in one call: the resize works in float32, so a group of huge images is
#: cut (64 Mpx: about 0.8 GB of float32 in and out) instead of running out of memory as a whole
GROUP_PIXELS = 2**26


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


def is_nvjpeg_fault(exc: BaseException) -> bool:
    """True for a sticky CUDA error as torch words it, or as nvJPEG's messages number it."""
    if is_device_fault(exc):
        return True
    found = _CUDA_STATUS.search(str(exc)) if isinstance(exc, RuntimeError) else None
    return found is not None and int(found.group(1)) in STICKY_CUDA_STATUS


#: what the decode thread hands back: images (None: refused), the tensors holding them, the event
#: after their last kernel (None off CUDA), seconds
Decoded = tuple[list["torch.Tensor | None"], list["torch.Tensor"], Any, float]


class DeviceJpegDecoder(DeviceDecoder):
    """Decodes a batch's JPEG payloads on `device` and applies `prep`'s resize and crop there, on a
    thread and (on CUDA) a stream of its own (see the module docstring)."""

    def __init__(self, prep: PixelPreprocessor, device: str) -> None:
        self.prep, self.device = prep, device
        self.cuda = device.startswith("cuda")
        self.decode = jpeg_decoder()
        self._thread: ThreadPoolExecutor | None = None

    def start(self, payloads: list[ImageInput]) -> "JpegBatch":
        """Queue the batch's JPEGs on the decode thread (the bytes are read in place: the payloads'
        memory must stay until `wait` returns)."""
        import torch

        jpegs = [i for i, p in enumerate(payloads) if p.meta.get("jpeg")]
        future = None
        if jpegs:
            data = [torch.from_numpy(_writable(payloads[i].pixels)) for i in jpegs]
            future = self._executor().submit(self._work, data)
        return JpegBatch(self, payloads, jpegs, future)

    def close(self) -> None:
        """Stop the decode thread once what was started is done."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="mmenc-jpeg", initializer=self._on_thread)
        return self._thread

    def _on_thread(self) -> None:
        """The decode thread's current device is the model's (a device process for cuda:1)."""
        if self.device.startswith("cuda:"):
            import torch

            torch.cuda.set_device(torch.device(self.device))

    def _work(self, data: list["torch.Tensor"]) -> Decoded:
        """On the decode thread: decode, resize and crop; on CUDA on the decode stream, with an
        event after the last kernel."""
        t0 = time.perf_counter()
        if not self.cuda:
            images, bases = self._preprocess_all(self._decode_all(data))
            return images, bases, None, time.perf_counter() - t0
        import torch

        stream = side_stream(self.device, "decode")
        with torch.cuda.stream(stream):
            images, bases = self._preprocess_all(self._decode_all(data))
            event = torch.cuda.Event()
            event.record(stream)
        return images, bases, event, time.perf_counter() - t0

    def _decode_all(self, data: list["torch.Tensor"]) -> list["torch.Tensor | None"]:
        """All in one call; after a failure, each half again (None where refused alone)."""
        return self._bisect(data)

    def _bisect(self, data: list["torch.Tensor"]) -> list["torch.Tensor | None"]:
        try:
            return self.decode(data, self.device)
        except Exception as exc:
            self._raise_device_fault(exc)
        if len(data) == 1:
            return [None]
        mid = len(data) // 2
        return self._bisect(data[:mid]) + self._bisect(data[mid:])

    def _preprocess_all(self, images: list["torch.Tensor | None"]) -> tuple[list["torch.Tensor | None"],
                                                                             list["torch.Tensor"]]:
        """Each image resized and cropped (None where it failed), resized in one call per size (at
        most `GROUP_PIXELS` a call); and the tensors that hold the results (each a view of one)."""
        out: list[torch.Tensor | None] = [None] * len(images)
        bases: list[torch.Tensor] = []
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            if image is not None:
                groups.setdefault(tuple(image.shape), []).append(i)
        for shape, same in groups.items():
            step = max(1, GROUP_PIXELS // (shape[-1] * shape[-2]))
            for members in (same[k:k + step] for k in range(0, len(same), step)):
                self._preprocess_group(images, members, out, bases)
        return out, bases

    def _preprocess_group(self, images: list[Any], members: list[int], out: list[Any], bases: list[Any]) -> None:
        """Resize and crop `members` (same-sized) into `out`; the group in one call, after a failure
        image by image."""
        for part in [members] if len(members) == 1 else [members, *([i] for i in members)]:
            batch = self._preprocessed([images[i] for i in part])
            if batch is not None:
                bases.append(batch)
                for k, i in enumerate(part):
                    out[i] = batch[k]
                if part is members:
                    break

    def _preprocessed(self, images: list["torch.Tensor"]) -> "torch.Tensor | None":
        """Same-sized images resized and cropped as one [n, 3, h, w] batch; None when that fails
        (e.g. out of memory on huge ones); a sticky device error raises `DeviceError`."""
        import torch

        try:
            return self.preprocess(torch.stack(images) if len(images) > 1 else images[0].unsqueeze(0))
        except Exception as exc:
            self._raise_device_fault(exc)
            return None

    def preprocess(self, images: "torch.Tensor") -> "torch.Tensor":
        """Resize (antialiased) and center-crop [..., 3, H, W] uint8 images as `prep` does on the CPU."""
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional as F

        prep, (h, w) = self.prep, images.shape[-2:]
        target = prep.size if prep.shortest_edge is None else shortest_edge_size(h, w, prep.shortest_edge)
        if target is not None and tuple(target) != (h, w):
            mode = InterpolationMode(_INTERPOLATION.get(prep.resample, "bicubic"))
            images = F.resize(images, list(target), interpolation=mode, antialias=True)
        if prep.crop is None:
            return images
        lead = images.shape[:-2]  # the crop works on [C, H, W]: the leading dims as one
        crop = center_crop_rounded if prep.rounded_crop else center_crop
        flat = crop(images.reshape(-1, *images.shape[-2:]), *prep.crop)
        return flat.unflatten(0, tuple(lead))

    def _raise_device_fault(self, exc: BaseException) -> None:
        """A sticky CUDA error is the device's, no image's: the run ends (`DeviceError`, exit 1).
        On CUDA the decode stream is synchronized first: a lost context raises there, whatever
        words the failed call used."""
        fault: BaseException | None = exc if is_nvjpeg_fault(exc) else None
        if fault is None and self.cuda:
            import torch

            try:
                torch.cuda.current_stream(self.device).synchronize()
            except Exception as probe:  # the stream cannot even be waited for: the device's state is lost
                fault = probe
        if fault is not None:
            raise DeviceError.of(fault, " while decoding JPEGs") from None


class JpegBatch(DecodeAhead):
    """One batch on the decode thread (`DeviceJpegDecoder.start`)."""

    def __init__(self, decoder: DeviceJpegDecoder, payloads: list[ImageInput], jpegs: list[int],
                 future: "Future[Decoded] | None") -> None:
        self.decoder, self.payloads, self.jpegs, self.future = decoder, payloads, jpegs, future

    def done(self) -> bool:
        """True once the decode thread is done with this batch."""
        return self.future is None or self.future.done()

    def wait(self) -> list[ImageInput | None]:
        """The batch's payloads, its JPEGs decoded (None where refused), usable on this thread's
        current stream: it waits for the batch's event, and the results' memory is marked as used
        there (not handed out again before this stream is done with it)."""
        out: list[ImageInput | None] = list(self.payloads)
        if self.future is None:
            return out
        images, bases, event, self.seconds = self.future.result()
        if event is not None:
            import torch

            current = torch.cuda.current_stream(self.decoder.device)
            current.wait_event(event)
            for base in bases:
                base.record_stream(current)
        for i, image in zip(self.jpegs, images):
            out[i] = None if image is None else ImageInput(image)
        return out


def _writable(data: np.ndarray) -> np.ndarray:
    """torch wants writable memory: a shared-memory slot is; bytes from a pickle are copied."""
    return data if data.flags.writeable else data.copy()
