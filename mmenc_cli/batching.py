"""Micro-batches: adaptive batch size, bisection of failed batches, OOM back-off.

`BatchRunner.run(modality, payloads)` encodes a list of payloads in micro-batches and returns one
outcome per payload, in order: a float32 numpy vector (or `[tokens, dim]` array) or an `MMError`.
A failing batch (an exception, or the wrong number of outputs) is split in halves until only the
guilty items fail. An out-of-memory error halves the modality's working batch size instead of
failing anything; after `grow_after` successes the size doubles back towards the configured one,
and each time a size it grew back into runs out of memory again, the wait before growing into it
doubles (so fixed-shape inputs that cannot fit stop retrying it, while memory that comes back is
used again). A single item that is out of memory alone fails with 507. The failed batch's
activations are freed before any retry. A sticky device error (`errors.is_device_fault`) is no
item's fault: it raises `DeviceError`, which ends the run.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .encoders.base import EncodeOutput
from .errors import DeviceError, MMError, classify, is_device_fault, is_out_of_memory, trim_message

log = logging.getLogger("mmenc")


@dataclass(slots=True)
class Outcome:
    """One payload's result: `value` (numpy array) or `error`, and whether its text was truncated."""

    value: np.ndarray | None = None
    error: MMError | None = None
    truncated: bool = False


@dataclass
class BatchStats:
    """Counters the pipeline reports: forward calls, seconds busy, OOM halvings and regrowths."""

    calls: int = 0
    seconds: float = 0.0
    oom_halvings: int = 0
    regrowths: int = 0
    bisections: int = 0
    events: list[str] = field(default_factory=list)


@dataclass
class _Size:
    """One modality's working batch size and its growth back towards the configured size."""

    size: int
    wait: int  # successes at a reduced size before growing; doubles when a regrown size fails again
    streak: int = 0
    grown_to: int | None = None  # the size the last growth reached


class BatchRunner:
    """Runs `encode_fn` over micro-batches with bisection and OOM back-off, sized per modality."""

    def __init__(self, encode_fn: Callable[[str, Sequence[Any]], EncodeOutput], batch_size: int,
                 grow_after: int = 8, free_memory: Callable[[], None] | None = None,
                 check: Callable[[str, Sequence[Any], list[np.ndarray]], list[MMError | None] | None] | None = None) -> None:
        self.encode_fn = encode_fn
        self.max_batch = batch_size
        self.grow_after = grow_after
        self.free_memory = free_memory or (lambda: None)
        self.check = check
        self.stats = BatchStats()
        self._sizes: dict[str, _Size] = {}

    def size(self, modality: str) -> int:
        """The working batch size of `modality` now."""
        return self._state(modality).size

    def run(self, modality: str, payloads: Sequence[Any]) -> list[Outcome]:
        """Encode `payloads` (one modality) and return one `Outcome` per payload, in order.
        Raises `DeviceError` when the device fails as a whole."""
        return self.launch(modality, payloads).outcomes()

    def launch(self, modality: str, payloads: Sequence[Any]) -> "Launched":
        """Run the forwards of `payloads` without waiting for the device: the vectors' copies to
        the host are under way when this returns, and `Launched.outcomes()` waits for them (the
        caller does other work meanwhile). Failures that the launch sees (an exception, out of
        memory, the wrong output count) are handled here, by bisection or back-off."""
        launched = Launched(modality, len(payloads), self.check)
        start = 0
        while start < len(payloads):
            size = min(self.size(modality), len(payloads) - start)
            self._encode_range(modality, payloads, start, start + size, launched)
            start += size
        return launched

    # -- internals --------------------------------------------------------------------------
    def _state(self, modality: str) -> _Size:
        return self._sizes.setdefault(modality, _Size(self.max_batch, self.grow_after))

    def _encode_range(self, modality: str, payloads: Sequence[Any], lo: int, hi: int, launched: "Launched") -> None:
        chunk = payloads[lo:hi]
        failure = None
        try:
            t0 = time.perf_counter()
            result = self.encode_fn(modality, chunk)
            count = len(result.vectors)
            if count != len(chunk):
                raise _CountMismatch(f"encoder returned {count} outputs for {len(chunk)} inputs")
            launched.parts.append(_Part(lo, chunk, HostCopy.start(result.vectors), result.truncated))
            self.stats.seconds += time.perf_counter() - t0
            self.stats.calls += 1
        except Exception as exc:  # per-batch failure: back off or bisect, never stop the run
            failure = _detached(exc)
        if failure is not None:  # outside the `except`: the failed forward's frames are gone
            result = None  # type: ignore[assignment]
            self._on_failure(modality, payloads, lo, hi, launched, failure)
            return
        self._success(modality)

    def _on_failure(self, modality: str, payloads: Sequence[Any], lo: int, hi: int,
                    launched: "Launched", exc: Exception) -> None:
        n = hi - lo
        if isinstance(exc, DeviceError):  # already the run's (e.g. the forward's timer met the fault)
            raise exc
        if is_device_fault(exc):
            raise DeviceError.of(exc) from None
        if is_out_of_memory(exc) or isinstance(exc, MemoryError):
            self.free_memory()
            if n == 1:
                message = f"out of memory with this item alone: {trim_message(str(exc), 200)}"
                launched.outcome[lo] = Outcome(error=MMError(message, stage="encode", reason="encode.out_of_memory",
                                                             error=type(exc).__name__))
                return
            self._halve(modality, n)
        elif n == 1:
            err = classify(exc, "encode")
            if isinstance(exc, _CountMismatch):
                err = MMError(err.message, stage="encode", reason="encode.output_count", error=err.error)
            launched.outcome[lo] = Outcome(error=err)
            return
        else:
            self.stats.bisections += 1
            log.info("batch of %d failed (%s: %s): bisecting", n, type(exc).__name__, trim_message(str(exc), 200))
        del exc
        mid = lo + n // 2
        self._encode_range(modality, payloads, lo, mid, launched)
        self._encode_range(modality, payloads, mid, hi, launched)

    def _halve(self, modality: str, n: int) -> None:
        """An out-of-memory batch of `n`: work at n // 2; a size grown into that failed again
        waits twice as long before the next growth."""
        st = self._state(modality)
        new = max(1, n // 2)
        if new < st.size or st.size >= n:
            st.size = new
        if st.grown_to is not None and n >= st.grown_to:
            st.wait *= 2
            st.grown_to = None
        self.stats.oom_halvings += 1
        st.streak = 0
        msg = f"out of memory at batch size {n}: halving to {new}"
        self.stats.events.append(msg)
        log.warning(msg)

    def _success(self, modality: str) -> None:
        st = self._state(modality)
        if st.size >= self.max_batch:
            return
        st.streak += 1
        if st.streak >= st.wait:
            old, st.size = st.size, min(self.max_batch, st.size * 2)
            st.streak, st.grown_to = 0, st.size
            self.stats.regrowths += 1
            msg = f"{st.wait} batches without running out of memory: growing batch size {old} -> {st.size}"
            self.stats.events.append(msg)
            log.warning(msg)


@dataclass
class _Part:
    """One forward that ran: its first payload's index, its payloads, its vectors on their way."""

    lo: int
    chunk: Sequence[Any]
    copy: "HostCopy"
    truncated: list[bool]


class Launched:
    """The forwards of one `BatchRunner.launch`; `outcomes()` waits for their vectors."""

    def __init__(self, modality: str, n: int, check: Any) -> None:
        self.modality, self.check = modality, check
        self.outcome: list[Outcome | None] = [None] * n  # failures known at launch
        self.parts: list[_Part] = []

    def outcomes(self) -> list[Outcome]:
        """One `Outcome` per payload, in order: the vectors as float32 numpy arrays on the host,
        checked there (finiteness, the encoder's own check). A device error while waiting raises
        `DeviceError`: no item is to blame."""
        for part in self.parts:
            vectors, finite = part.copy.wait()
            checks = (self.check(self.modality, part.chunk, vectors) if self.check else None) or [None] * len(vectors)
            truncated = part.truncated or [False] * len(vectors)
            for i, (vec, trunc, err) in enumerate(zip(vectors, truncated, checks)):
                if err is None and not finite[i]:
                    err = MMError("embedding holds NaN or Inf", stage="encode", reason="encode.non_finite")
                self.outcome[part.lo + i] = Outcome(value=None if err else vec, error=err, truncated=bool(trunc))
        self.parts = []
        return [o if o is not None else Outcome(error=MMError("no outcome", reason="internal")) for o in self.outcome]


class HostCopy:
    """A forward's vectors copied to the host without blocking: on CUDA, a non-blocking copy into
    pinned memory and an event after it, waited for in `wait()`; elsewhere already there."""

    def __init__(self, host: list[Any], event: Any, many: bool) -> None:
        self.host, self.event, self.many = host, event, many

    @classmethod
    def start(cls, vectors: Any) -> "HostCopy":
        many = isinstance(vectors, (list, tuple))
        tensors = list(vectors) if many else [vectors]
        if not any(getattr(t, "is_cuda", False) for t in tensors):
            return cls(tensors, None, many)
        import torch

        host = [t.detach().to("cpu", non_blocking=True) for t in tensors]  # pinned destination
        event = torch.cuda.Event()
        event.record()
        return cls(host, event, many)

    def wait(self) -> tuple[list[np.ndarray], list[bool]]:
        """(float32 arrays, finite per output) once the copy is done."""
        if self.event is not None:
            try:
                self.event.synchronize()
            except Exception as exc:  # an asynchronous CUDA error surfaces here: the device's, no item's
                raise DeviceError.of(exc) from None
        return _to_numpy(self.host if self.many else self.host[0])


def _detached(exc: Exception) -> Exception:
    """`exc` without its tracebacks (and theirs of its causes), the finished frames cleared: what
    the failed forward allocated is freed before a retry."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return exc


class _CountMismatch(RuntimeError):
    """The encoder returned a different number of outputs than inputs."""


def _to_numpy(vectors: Any) -> tuple[list[np.ndarray], list[bool]]:
    """Tensors (pooled [n, dim] or a list of [tokens, dim]) to float32 numpy arrays on the CPU,
    and per output whether it is free of NaN/Inf.

    A pooled batch is one device-to-host copy and one vectorized finiteness test; its rows are
    views of that [n, dim] array.
    """
    if isinstance(vectors, (list, tuple)):
        arrays = [_tensor_np(v) for v in vectors]
        return arrays, [bool(np.isfinite(a).all()) for a in arrays]
    matrix = _tensor_np(vectors)
    if matrix.ndim != 2:
        rows = list(matrix)
        return rows, [bool(np.isfinite(r).all()) for r in rows]
    return list(matrix), np.isfinite(matrix).all(axis=1).tolist()


def _tensor_np(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t.astype(np.float32, copy=False)
    return t.detach().float().cpu().numpy()
