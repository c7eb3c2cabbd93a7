"""Two CPU batch streams: each batch split in halves that run concurrently, each on half of torch's threads.

Two independent forwards keep the cores busy through the serial stretches and OpenMP barriers of
one forward (layer norms, softmax, Python between ops): ~10% more texts/s for MiniLM on two cores.
The model's `PathChoice` (oneDNN's or PyTorch's linears) is told when each full batch begins and
how long it took, so its probes compare like with like.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..forward import Inputs, PlainForward, Prepare
from .choice import PathChoice

if TYPE_CHECKING:  # pragma: no cover
    import torch

_TORCH_THREADS: list[int] = []  # torch's own thread count, before the first CPU encoder changed it


MIN_STREAM_ITEMS = 8  # a batch is split across streams only into parts at least this big


def _units(inputs: Inputs) -> int:
    """A batch's size for timing: its token ids or pixels (padded), else 0 (not timed)."""
    for key in ("input_ids", "pixel_values"):
        if key in inputs:
            return int(inputs[key].numel())
    return 0


@contextlib.contextmanager
def _all_threads(active: bool) -> Iterator[None]:
    """Run a lone batch part (a small batch, a bisected chunk) with all of torch's CPU threads,
    not the share each of several concurrent streams gets."""
    if not active or not _TORCH_THREADS:
        yield
        return
    import torch

    share = torch.get_num_threads()
    torch.set_num_threads(_TORCH_THREADS[0])
    try:
        yield
    finally:
        torch.set_num_threads(share)


def set_streams(wanted: int) -> int:
    """Run `wanted` batch parts concurrently (at most torch's thread count), each with its share of
    torch's threads; return how many. Torch's own count is remembered from the first call, so a
    later encoder in the same process starts from it again."""
    import torch

    if not _TORCH_THREADS:
        _TORCH_THREADS.append(torch.get_num_threads())
    total = _TORCH_THREADS[0]
    streams = max(1, min(wanted, total))
    torch.set_num_threads(max(1, total // streams))
    return streams


class StreamedForward(PlainForward):
    """A batch's contiguous parts run on `streams` threads at once (a lone part on all threads);
    `choice` (None when oneDNN's linears are not in use) picks each batch's linears."""

    def __init__(self, streams: int, choice: PathChoice | None, mode: str) -> None:
        super().__init__("cpu", mode)
        self.streams, self.choice = streams, choice
        self.pool = ThreadPoolExecutor(streams, thread_name_prefix="mmenc-cpu") if streams > 1 else None

    def split(self, payloads: Sequence[Any]) -> list[Sequence[Any]]:
        """Contiguous parts of a batch, one per stream (the whole batch when it is small)."""
        n = len(payloads)
        k = min(self.streams, n // MIN_STREAM_ITEMS) if self.pool is not None else 1
        if k <= 1:
            return [payloads]
        bounds = [n * i // k for i in range(k + 1)]
        return [payloads[bounds[i]:bounds[i + 1]] for i in range(k)]

    def run(self, payloads: Sequence[Any], prepare: Prepare,
            forward: Callable[[Inputs], "torch.Tensor"]) -> tuple["torch.Tensor", list[bool]]:
        """The batch's float32 outputs, in order, and its truncation flags."""
        import torch

        parts = self.split(payloads)
        if self.choice is not None:
            self.choice.begin()  # which CPU linears this batch runs on
        t0 = time.perf_counter()
        if len(parts) == 1:
            with torch.inference_mode(), _all_threads(self.pool is not None):
                inputs, truncated = prepare(payloads)
                vectors = forward(inputs).float()
            if self.choice is not None and self.pool is None:  # timed like every batch of a one-stream run
                self.choice.end(time.perf_counter() - t0, _units(inputs))
            return vectors, truncated
        outputs, truncated, units = self._run_parts(parts, prepare, forward)
        if self.choice is not None and len(parts) == self.streams:  # full batches only: same threads per part
            self.choice.end(time.perf_counter() - t0, units)
        return torch.cat(outputs), truncated

    def _run_parts(self, parts: list[Sequence[Any]], prepare: Prepare,
                   forward: Callable[[Inputs], "torch.Tensor"]) -> tuple[list["torch.Tensor"], list[bool], int]:
        """Start each part's forward on a stream while the next part's inputs are made here
        (tokenizers are not safe to share across threads); wait for every part before raising,
        so no forward outlives the call."""
        import torch

        assert self.pool is not None
        futures, truncated, error, units = [], [], None, 0
        for part in parts:
            try:
                with torch.inference_mode():
                    inputs, part_truncated = prepare(part)
            except Exception as exc:
                error = exc
                break
            futures.append(self.pool.submit(_forward_on_thread, forward, inputs))
            truncated += part_truncated
            units += _units(inputs)
        outputs = []
        for future in futures:
            try:
                outputs.append(future.result())
            except Exception as exc:  # the batching stage bisects or backs off on it
                error = error or exc
        if error is not None:
            raise error
        return outputs, truncated, units

    def summary(self) -> dict[str, Any]:
        """The CPU path used: streams, linears and the probes' evidence."""
        linears = "pytorch"
        if self.choice is not None:
            linears = "onednn" if self.choice.fixed or self.choice.choice else "pytorch"
        return {"mode": self.mode, "streams": self.streams, "linears": linears,
                "evidence": None if self.choice is None else self.choice.summary()}


def _forward_on_thread(forward: Callable[[Inputs], "torch.Tensor"], inputs: Inputs) -> "torch.Tensor":
    import torch

    with torch.inference_mode():  # thread-local: entered again on the stream's thread
        return forward(inputs).float()
