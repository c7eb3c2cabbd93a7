"""Micro-batches: adaptive batch size, bisection of failed batches, OOM back-off.

`BatchRunner.run(modality, payloads)` encodes a list of payloads in micro-batches and returns one
outcome per payload, in order: a float32 numpy vector (or `[tokens, dim]` array) or an `MMError`.
A failing batch (an exception, or the wrong number of outputs) is split in halves until only the
guilty items fail. An out-of-memory error halves the working batch size instead of failing
anything; after `grow_after` successes the size doubles back towards the configured one. A single
item that is out of memory alone fails with 507.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .encoders.base import EncodeOutput
from .errors import MMError, classify, is_out_of_memory, trim_message

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


class BatchRunner:
    """Runs `encode_fn` over micro-batches with bisection and OOM back-off."""

    def __init__(self, encode_fn: Callable[[str, Sequence[Any]], EncodeOutput], batch_size: int,
                 grow_after: int = 8, free_memory: Callable[[], None] | None = None,
                 check: Callable[[str, Sequence[Any], list[np.ndarray]], list[MMError | None] | None] | None = None) -> None:
        self.encode_fn = encode_fn
        self.max_batch = batch_size
        self.batch_size = batch_size
        self.grow_after = grow_after
        self.free_memory = free_memory or (lambda: None)
        self.check = check
        self.stats = BatchStats()
        self._streak = 0

    def run(self, modality: str, payloads: Sequence[Any]) -> list[Outcome]:
        """Encode `payloads` (one modality) and return one `Outcome` per payload, in order."""
        outcomes: list[Outcome | None] = [None] * len(payloads)
        start = 0
        while start < len(payloads):
            size = min(self.batch_size, len(payloads) - start)
            self._encode_range(modality, payloads, start, start + size, outcomes, top=True)
            start += size
        return [o if o is not None else Outcome(error=MMError("no outcome", reason="internal")) for o in outcomes]

    # -- internals --------------------------------------------------------------------------
    def _encode_range(self, modality: str, payloads: Sequence[Any], lo: int, hi: int,
                      outcomes: list[Outcome | None], top: bool) -> None:
        chunk = payloads[lo:hi]
        try:
            t0 = time.perf_counter()
            result = self.encode_fn(modality, chunk)
            vectors, finite = _to_numpy(result.vectors)
            self.stats.seconds += time.perf_counter() - t0
            self.stats.calls += 1
            if len(vectors) != len(chunk):
                raise _CountMismatch(f"encoder returned {len(vectors)} outputs for {len(chunk)} inputs")
        except Exception as exc:  # per-batch failure: back off or bisect, never stop the run
            self._on_failure(modality, payloads, lo, hi, outcomes, exc)
            return
        checks = (self.check(modality, chunk, vectors) if self.check else None) or [None] * len(chunk)
        truncated = result.truncated or [False] * len(chunk)
        for i, (vec, trunc, err) in enumerate(zip(vectors, truncated, checks)):
            if err is None and not finite[i]:
                err = MMError("embedding holds NaN or Inf", stage="encode", reason="encode.non_finite")
            outcomes[lo + i] = Outcome(value=None if err else vec, error=err, truncated=bool(trunc))
        self._success()

    def _on_failure(self, modality: str, payloads: Sequence[Any], lo: int, hi: int,
                    outcomes: list[Outcome | None], exc: Exception) -> None:
        n = hi - lo
        if is_out_of_memory(exc) or isinstance(exc, MemoryError):
            self.free_memory()
            if n == 1:
                outcomes[lo] = Outcome(error=MMError(f"out of memory with this item alone: {trim_message(str(exc), 200)}",
                                                     stage="encode", reason="encode.out_of_memory",
                                                     error=type(exc).__name__))
                self.batch_size = max(self.batch_size, 1)
                return
            new = max(1, n // 2)
            if new < self.batch_size or self.batch_size >= n:
                self.batch_size = new
            self.stats.oom_halvings += 1
            self._streak = 0
            msg = f"out of memory at batch size {n}: halving to {new}"
            self.stats.events.append(msg)
            log.warning(msg)
        else:
            if n == 1:
                reason = "encode.output_count" if isinstance(exc, _CountMismatch) else None
                err = classify(exc, "encode")
                if reason:
                    err = MMError(err.message, stage="encode", reason=reason, error=err.error)
                outcomes[lo] = Outcome(error=err)
                return
            self.stats.bisections += 1
            log.info("batch of %d failed (%s: %s): bisecting", n, type(exc).__name__, trim_message(str(exc), 200))
        mid = lo + n // 2
        self._encode_range(modality, payloads, lo, mid, outcomes, top=False)
        self._encode_range(modality, payloads, mid, hi, outcomes, top=False)

    def _success(self) -> None:
        if self.batch_size >= self.max_batch:
            return
        self._streak += 1
        if self._streak >= self.grow_after:
            old, self.batch_size = self.batch_size, min(self.max_batch, self.batch_size * 2)
            self._streak = 0
            self.stats.regrowths += 1
            msg = f"{self.grow_after} batches without running out of memory: growing batch size {old} -> {self.batch_size}"
            self.stats.events.append(msg)
            log.warning(msg)


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
