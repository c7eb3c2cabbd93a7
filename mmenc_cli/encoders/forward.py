"""How one batch's forward runs: plainly on one stream, timed with CUDA events on a GPU.

`PlainForward` is PyTorch's own forward for the whole batch (every accelerator, `--compile`, and
`--cpu-forward plain`); `cpu.streams.StreamedForward` is the CPU's two-stream variant. Both take
the batch's payloads, a `prepare` that turns payloads into model inputs on the calling thread, and
the model function, and return float32 outputs and the texts' truncation flags.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import DeviceError, first_line, is_device_fault, is_out_of_memory

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("mmenc")

Inputs = dict[str, "torch.Tensor"]
#: payloads -> (model inputs, per-text truncation flags)
Prepare = Callable[[Sequence[Any]], tuple[Inputs, list[bool]]]


class PlainForward:
    """The whole batch in one forward on the calling thread; `mode` is the requested
    `--cpu-forward`, recorded with what ran."""

    streams = 1

    def __init__(self, device: str, mode: str) -> None:
        self.device, self.mode = device, mode
        self.timer = ForwardTimer(device)
        self.compile_seconds: float | None = None  # wall time of forwards that compiled (`--compile`)

    def run(self, payloads: Sequence[Any], prepare: Prepare,
            forward: Callable[[Inputs], "torch.Tensor"]) -> tuple["torch.Tensor", list[bool]]:
        """The batch's float32 outputs and its truncation flags. A forward that compiled is not
        forward time: its wall time goes to `compile_seconds`."""
        import time

        import torch

        with torch.inference_mode():
            inputs, truncated = prepare(payloads)
            t0 = time.perf_counter()
            with self.timer:
                vectors = forward(inputs).float()
        if isinstance(forward, CompiledOrEager):
            self.compile_seconds = self.compile_seconds or 0.0
            if forward.compiled_now:
                self.timer.discard_last()
                self.compile_seconds += time.perf_counter() - t0
        return vectors, truncated

    def device_seconds(self) -> float | None:
        """Seconds the accelerator spent in forward passes so far (CUDA events), None elsewhere."""
        return self.timer.seconds()

    def summary(self) -> dict[str, Any]:
        """What ran: PyTorch's own forward, one stream (on the CPU; `None` fields elsewhere)."""
        on_cpu = self.device == "cpu"
        summary = {"mode": self.mode, "streams": 1 if on_cpu else None, "linears": "pytorch" if on_cpu else None,
                   "evidence": None}
        if self.compile_seconds is not None:
            summary["compile_seconds"] = round(self.compile_seconds, 3)
        if self.device.startswith("cuda"):
            import torch

            summary["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(torch.device(self.device)))
        return summary


class ForwardTimer:
    """Times forward passes on a CUDA device with CUDA events, without synchronizing: the events
    of a pass are read once the GPU has passed them (the pipeline's copy of the vectors to the
    host waits for that anyway). A no-op elsewhere. Used as `with timer: forward()`."""

    def __init__(self, device: str) -> None:
        self.cuda = str(device).startswith("cuda")
        self._pending: list[tuple[Any, Any]] = []
        self._done = 0.0

    def __enter__(self) -> None:
        if self.cuda:
            import torch

            self._collect(wait=False)  # the passes before this one (the last may still be discarded)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self._pending.append((begin, end))

    def __exit__(self, *exc: Any) -> None:
        if self.cuda and self._pending:
            self._pending[-1][1].record()

    def discard_last(self) -> None:
        """Leave the last pass out of the device time (it compiled: not the model's work)."""
        if self.cuda and self._pending:
            self._pending.pop()

    def _collect(self, wait: bool) -> None:
        """Add the passes the device is done with (all of them with `wait`). A sticky CUDA error
        can first show here, where nothing else has waited for the device since it happened: it is
        the device's, and raises `DeviceError` (the run ends as after a failed forward)."""
        keep = []
        try:
            for begin, end in self._pending:
                if wait or end.query():
                    end.synchronize()
                    self._done += begin.elapsed_time(end) / 1000.0
                else:
                    keep.append((begin, end))
        except Exception as exc:
            self._pending = []  # a lost context's events never complete: not read again
            if is_device_fault(exc):
                raise DeviceError.of(exc, " (seen reading the forward's CUDA-event timer)") from None
            raise
        self._pending = keep

    def seconds(self) -> float | None:
        """The forward's device seconds so far; `DeviceError` when the device failed meanwhile."""
        if not self.cuda:
            return None
        self._collect(wait=True)
        return self._done


class CompiledOrEager:
    """Calls `fn` through `torch.compile`; if compiling fails, warns once and stays eager.

    The batch dimension of every input (and the length of 2-D integer inputs, texts' token ids
    and masks) is marked dynamic, so a new batch size or text length reuses the compiled code
    instead of compiling again. `compiled_now` says whether the last call compiled (its time is
    compile time, not forward time). A failure on a call that also fails eagerly is the input's
    fault, not the compiler's: it is raised and compilation is kept.
    """

    def __init__(self, fn: Callable[[Inputs], "torch.Tensor"], name: str) -> None:
        import torch

        self.fn, self.name, self.proven, self.compiled_now = fn, name, False, False
        self.compiled: Callable[[Inputs], "torch.Tensor"] | None = torch.compile(fn)

    def __call__(self, inputs: Inputs) -> "torch.Tensor":
        self.compiled_now = False
        if self.compiled is None:
            return self.fn(inputs)
        _mark_dynamic(inputs)
        graphs = _compiled_graphs()
        failure = None
        try:
            out = self.compiled(inputs)
        except Exception as exc:
            compiler = type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))
            if is_out_of_memory(exc) or (self.proven and not compiler):
                raise  # the batch's (the runner halves it or bisects), not the compiler's
            failure = f"{type(exc).__name__}: {first_line(exc)}"
        if failure is not None:  # outside the `except`: the failed attempt's tensors are freed first
            out = self.fn(inputs)  # raises if the input itself is at fault
            log.warning("torch.compile failed for %s (%s); running eager", self.name, failure)
            self.compiled = None
            return out
        self.compiled_now = not self.proven or (graphs is not None and _compiled_graphs() != graphs)
        self.proven = True
        return out


def _mark_dynamic(inputs: Inputs) -> None:
    """Dim 0 of every tensor input (the batch), and dim 1 of 2-D integer ones (token ids and
    masks: the text length), may change between calls."""
    import torch

    for t in inputs.values():
        if isinstance(t, torch.Tensor) and t.ndim >= 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            if t.ndim == 2 and not t.is_floating_point():
                torch._dynamo.maybe_mark_dynamic(t, 1)


def _compiled_graphs() -> int | None:
    """How many graphs dynamo has compiled in this process (None where torch does not say)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # an internal counter: without it only the first call counts as compiling
        return None
