"""Device and dtype resolution, backend settings and host-to-device copies, shared by the encoders.

torch is imported inside the functions so that importing this module stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ModelLoadError
from .cpu.malloc import keep_freed_memory

if TYPE_CHECKING:  # pragma: no cover
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
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def configure_backend(device: str) -> None:
    """Allow TF32 matmuls/convolutions on CUDA: float32 work (e.g. pixel normalization, float32
    models) runs on tensor cores; embeddings do not need the last mantissa bits. Keep freed
    tensor memory in the process (`keep_freed_memory`)."""
    import torch

    keep_freed_memory()
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def to_device(tensor: "torch.Tensor", device: str) -> "torch.Tensor":
    """Move a CPU tensor to `device`; on CUDA through pinned memory so the copy is asynchronous."""
    if device.startswith("cuda"):
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
