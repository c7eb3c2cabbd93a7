"""Which of two equivalent CPU forward paths a run uses, chosen by timing the run's own batches.

oneDNN's packed, fused linears (`hf.use_onednn_linears`) compute what PyTorch's own linears
compute (float32, |diff| ~1e-6 relative), but which is faster depends on the CPU: on the MiniLM
forward with two threads, +4-6% on an Intel Xeon with AVX-512 (2026-12-03), and 18% slower over
a whole 10k-text run on an AVX2 AMD EPYC where MKL's sgemm runs near the core's peak (same day).
A choice fixed in the code is wrong on one of them, and a load-time micro-benchmark does not see
what the run sees (batch shapes, kernel creation for each new shape, cache and allocator state).

So `PathChoice` times the run's own batches. Every timed batch runs on the current path except
probes, which run on the other one: after `WARMUP` untimed batches, every second batch at first (`EARLY_PROBES` probes), then one
in `PERIOD`. A probe is scored against the mean time per unit of input of the batches just
before and after it (texts are sorted by length, so neighbours have nearly the same shape, and
the mean of both cancels the growth in length to first order). The path used is the one the
median of the last `KEEP` scores favours, by more than `MARGIN`; otherwise the reference path
(PyTorch's own), which the run starts on. At most one batch in `PERIOD` runs on the slower path
once the early probes are done.

Pure Python (no torch): the caller sets the flag the patched layers read from `on`.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

log = logging.getLogger("mmenc")

WARMUP = 2  # batches not timed: the encoder's load-time probe and the run's first batch
EARLY_PROBES = 6  # probes on every second batch after the warm-up batch
PERIOD = 16  # then one probe per this many batches
KEEP = 9  # scores the choice is the median of
MARGIN = 0.02  # the other path must be this much faster (time per unit) to be chosen


class PathChoice:
    """`begin()` before a batch says which path it runs on (`True`: the alternative, e.g.
    oneDNN; `False`: the reference, PyTorch's own); `end(seconds, units)` after it records its
    time. `fixed` pins the path (no probes). Calls that are not timed (a failed batch, a lone
    small part on all threads) just do not call `end`."""

    def __init__(self, name: str, fixed: bool | None = None) -> None:
        self.name = name
        self.fixed = fixed
        self.choice = bool(fixed)  # the path batches run on, probes aside
        self.on = self.choice  # the path of the batch in flight
        self.scores: deque[float] = deque(maxlen=KEEP)  # alternative's time / reference's, per probe
        self.counts = [0, 0]  # timed batches on [reference, alternative]
        self._seen = 0  # batches begun (the first WARMUP are not timed)
        self._timed: list[tuple[bool, bool, float]] = []  # (on, probe, seconds per unit), last 3

    def begin(self) -> bool:
        if self.fixed is not None:
            return self.fixed
        n = self.counts[0] + self.counts[1]
        self.on = not self.choice if self._seen >= WARMUP and self._is_probe(n) else self.choice
        self._seen += 1
        return self.on

    @staticmethod
    def _is_probe(n: int) -> bool:
        """Whether the n-th timed batch (from 0) is a probe: 1, 3, ... then one per PERIOD."""
        early = 2 * EARLY_PROBES
        if n < early:
            return n % 2 == 1
        return (n - early) % PERIOD == PERIOD - 1

    def end(self, seconds: float, units: int) -> None:
        """Record the batch begun last: `seconds` of wall time for `units` of input."""
        if self.fixed is not None or self._seen <= WARMUP or units <= 0 or seconds <= 0:
            return  # pinned, a warm-up batch, or nothing measured
        n = self.counts[0] + self.counts[1]
        self.counts[int(self.on)] += 1
        self._timed = (self._timed + [(self.on, self._is_probe(n), seconds / units)])[-3:]
        if len(self._timed) < 3:
            return
        (a_on, a_probe, a), (p_on, probe, p), (b_on, b_probe, b) = self._timed
        if not probe or a_probe or b_probe or a_on != b_on or p_on == a_on:
            return
        ratio = p / ((a + b) / 2)  # the probed path's time per unit / the current path's
        self.scores.append(ratio if p_on else 1.0 / ratio)
        self._decide()

    def _decide(self) -> None:
        median = statistics.median(self.scores)
        choice = median < 1.0 - MARGIN
        if choice != self.choice:
            log.info("CPU forward: %s takes %.2fx the time of PyTorch's own path (median of the last %d "
                     "probes): switching to %s", self.name, median, len(self.scores),
                     self.name if choice else "PyTorch's own path")
        self.choice = choice

    def summary(self) -> str:
        """What the run did, for the log: the path used and the evidence."""
        if self.fixed is not None:
            return f"{self.name} {'on' if self.fixed else 'off'} (fixed)"
        path = self.name if self.choice else "PyTorch's own path"
        if not self.scores:
            return f"{path} (no probe scored yet)"
        return (f"{path}: {self.name} takes {statistics.median(self.scores):.2f}x PyTorch's time "
                f"(median of {len(self.scores)} probes; {self.counts[1]} of {sum(self.counts)} timed batches on {self.name})")
