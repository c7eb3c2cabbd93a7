"""Device and dtype resolution, shared by the encoders and the pipeline.

torch is imported inside the functions so that importing this module stays cheap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from typing import TYPE_CHECKING

log = logging.getLogger("mmenc")

if TYPE_CHECKING:  # pragma: no cover
    import torch


def resolve_device(device: str | None = "auto") -> str:
    """Turn `auto` into `cuda`, else `mps`, else `cpu`; check that an explicit accelerator exists.

    Raises `ModelLoadError` for `cuda`/`mps` on a machine without one, so the run fails at
    startup with one clear line instead of at the first batch.
    """
    import torch

    from . import ModelLoadError

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


#: glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_SET: list[bool] = []


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to reuse freed tensor memory instead of returning it to the kernel.

    CPU tensors of a forward pass (activations of a batch: a few MB each) are allocated and freed
    by the hundred per batch. glibc serves blocks above its mmap threshold with fresh `mmap`s and
    gives them back on free, so each one page-faults again on first touch; its threshold adapts
    only to sizes it has already seen, which with batches sorted by length (growing shapes) are
    always new. With the threshold at its documented maximum (32 MiB on 64-bit) and the heap
    trimmed only above 1 GiB freed, activations are recycled: the fresh-process slow start of the first pass over the shapes is
    gone (PyTorch's CPU tuning guides swap in jemalloc/tcmalloc for the same reason). Peak memory
    is unchanged: what is kept is what the largest batch needed anyway.

    Linux with glibc only; once per process; skipped when the user tunes malloc already (any
    `MALLOC_*` variable, `glibc.malloc.*` in `GLIBC_TUNABLES`) or sets `MMENC_MALLOC=0`. Returns whether the settings were applied.
    """
    if _MALLOC_SET:
        return _MALLOC_SET[0]
    applied = False
    user_tuned = (any(k.startswith("MALLOC_") for k in os.environ)
                  or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))
    if sys.platform.startswith("linux") and not user_tuned and os.environ.get("MMENC_MALLOC", "1") != "0":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            applied = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))
        except (OSError, AttributeError) as exc:  # musl and other libcs have no mallopt
            log.debug("mallopt unavailable: %s", exc)
    _MALLOC_SET.append(applied)
    return applied
