"""The CPU forward, behind one switch: `--cpu-forward auto|plain|onednn`.

`make_forward` returns the object an encoder hands each batch to:

* `plain`: PyTorch's own forward, one stream (`forward.PlainForward`); also what every accelerator
  and `--compile` get.
* `onednn`: the model's `nn.Linear` layers through oneDNN on weights packed at load, GELUs and
  residual adds fused (`onednn.py`), and each batch split in two halves run concurrently
  (`streams.py`).
* `auto` (default): the same two streams, and oneDNN's or PyTorch's linears batch by batch as timed
  probes of the run's own batches find faster (`choice.py`); the vectors agree within 1e-5.

Loading a model also tells glibc's malloc to keep freed tensor memory (`malloc.py`).
"""

from __future__ import annotations

from typing import Any

from ..forward import PlainForward
from .onednn import cpu_path_choice, use_onednn_linears
from .streams import StreamedForward, set_streams

__all__ = ["make_forward"]

#: batch streams on the CPU in `auto` and `onednn` modes
CPU_STREAMS = 2


def make_forward(mode: str, model: Any, device: str, compile: bool) -> PlainForward:
    """The batch forward for `--cpu-forward MODE` with `model` on `device` (patches the model's
    linears for `auto` and `onednn`; under `--compile` inductor packs CPU linears itself)."""
    if device != "cpu":
        return PlainForward(device, mode)
    if compile or mode == "plain":
        set_streams(1)
        return PlainForward(device, mode)
    switched = use_onednn_linears(model, pinned=mode == "onednn")
    return StreamedForward(set_streams(CPU_STREAMS), cpu_path_choice(model) if switched else None, mode)
