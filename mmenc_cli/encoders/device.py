"""Device and dtype resolution, backend settings and host-to-device copies, shared by the encoders.

torch is imported inside the functions so that importing this module stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import ModelLoadError
from .cpu.malloc import keep_freed_memory

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch


def resolve_device(device: str | None = "auto") -> str:
    """Turn `auto` into `cuda`, else `mps`, else `cpu`; check that an explicit accelerator exists.

    Raises `ModelLoadError` for `cuda`/`mps` on a machine without one, so the run fails at
    startup with one clear line instead of at the first batch.
    """
    import torch

    device = (device or "auto").strip()
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        return "mps" if mps is not None and mps.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
        index = device.partition(":")[2]
        if index and int(index) >= torch.cuda.device_count():
            raise ModelLoadError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("device 'mps' requested but MPS is not available")
    return device


def resolve_dtype(dtype: str, device: str) -> "torch.dtype":
    """`auto`: bfloat16 on CUDA with bf16 support, float16 on other CUDA, float32 on CPU/MPS."""
    import torch

    if dtype == "auto":
        if not device.startswith("cuda"):
            return torch.float32
        # this device's capability (Ampere and later have bf16), asked without creating a tensor:
        # a device process for cuda:1 must not open a CUDA context on the current device, GPU 0
        major = torch.cuda.get_device_properties(torch.device(device)).major
        return torch.bfloat16 if major >= 8 or torch.version.hip else torch.float16
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def configure_backend(device: str) -> None:
    """Make `cuda:N` this process's current device (a device process's CUDA events, streams and
    context are then on its own GPU, not on GPU 0). Allow TF32 matmuls/convolutions on CUDA:
    float32 work (e.g. pixel normalization, float32 models) runs on tensor cores; embeddings do
    not need the last mantissa bits. Keep freed tensor memory in the process (`keep_freed_memory`)."""
    import torch

    keep_freed_memory()
    if device.startswith("cuda:"):  # this process's current device: CUDA events, streams, its context
        torch.cuda.set_device(torch.device(device))
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def stack_to_device(arrays: Sequence["np.ndarray"], device: str) -> "torch.Tensor":
    """Same-shaped numpy arrays (or tensors already on the device) as one batch tensor on `device`.
    On CUDA numpy arrays are stacked straight into pinned host memory (one copy, e.g. out of the
    decode workers' shared memory) and copied on asynchronously, on a copy stream; PyTorch's
    pinned-memory cache reuses that buffer only once the copy is done."""
    import numpy as np
    import torch

    if any(isinstance(a, torch.Tensor) for a in arrays):  # some decoded on the device (--decode gpu)
        return torch.stack([a if isinstance(a, torch.Tensor) else to_device(torch.from_numpy(a), device)
                            for a in arrays]).to(device)
    if not device.startswith("cuda"):
        return torch.from_numpy(np.stack(arrays)).to(device)
    dtype = torch.from_numpy(np.empty(0, dtype=arrays[0].dtype)).dtype
    host = torch.empty((len(arrays), *arrays[0].shape), dtype=dtype, pin_memory=True)
    np.stack(arrays, out=host.numpy())
    return _copy_on_side_stream(host, device)


#: one side stream per CUDA device (see `on_side_stream`)
_SIDE_STREAMS: dict[str, Any] = {}


def _copy_on_side_stream(host: "torch.Tensor", device: str) -> "torch.Tensor":
    """Copy a pinned batch to the device on the side stream, so the copy runs while the previous
    batch's forward still computes on the current stream."""
    return on_side_stream(device, lambda: [host.to(device, non_blocking=True)])[0]


def on_side_stream(device: str, work: Callable[[], list[Any]]) -> list[Any]:
    """Run `work` (returning tensors, or None) on `device`'s side stream; then the current stream
    waits for it, and each tensor is marked as used on the current stream (its memory is not
    handed out again before the current stream is done with it)."""
    import torch

    current = torch.cuda.current_stream(device)
    side = side_stream(device)
    with torch.cuda.stream(side):
        out = work()
    current.wait_stream(side)
    for tensor in out:
        if tensor is not None:
            tensor.record_stream(current)
    return out


def side_stream(device: str, purpose: str = "copy") -> Any:
    """`device`'s stream for `purpose`, made on first use: "copy" (batches copied to the device,
    `on_side_stream`) or "decode" (`--decode gpu`'s thread), so neither waits behind the other."""
    import torch

    key = device if purpose == "copy" else f"{device} {purpose}"
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return stream


def to_device(tensor: "torch.Tensor", device: str) -> "torch.Tensor":
    """Move a CPU tensor to `device`; on CUDA through pinned memory so the copy is asynchronous."""
    if device.startswith("cuda"):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
