"""Which of two equivalent CPU forward paths a run uses, chosen by timing the run's own batches.

oneDNN's packed, fused linears (`onednn.use_onednn_linears`) compute what PyTorch's own linears
compute (float32, |diff| ~1e-6 relative), but which is faster depends on the CPU: on the MiniLM
forward with two threads, +4-6% on an Intel Xeon with AVX-512, and 18% slower over a whole
10k-text run on an AVX2 AMD EPYC where MKL's sgemm runs near the core's peak.
A choice fixed in the code is wrong on one of them, and a load-time micro-benchmark does not see
what the run sees (batch shapes, kernel creation for each new shape, cache and allocator state).

So `PathChoice` times the run's own batches. Every timed batch runs on the current path except
probes, which run on the other one: after `WARMUP` untimed batches, every second batch at first (`EARLY_PROBES` probes), then one
in `PERIOD`, a gap that doubles (up to `MAX_PERIOD`) while the probes keep finding the current
path faster by `DECISIVE` or more, and falls back to `PERIOD` at the first that does not. A probe is scored against the mean time per unit of input of the batches just
before and after it (texts are sorted by length, so neighbours have nearly the same shape, and
the mean of both cancels the growth in length to first order). The path used is the one the
median of the last `KEEP` scores favours, by more than `MARGIN`; otherwise the reference path
(PyTorch's own), which the run starts on. At most one batch in `PERIOD` runs on the slower path
once the early probes are done; where one path is clearly faster (oneDNN's linears took 0.73-0.90x
PyTorch's time on an AMD EPYC Zen 4 with AVX-512), one in `MAX_PERIOD`, since each
probe there costs the difference.

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
MAX_PERIOD = 128  # ... up to one per this many while the probes find the current path clearly faster
DECISIVE = 0.10  # "clearly": the probed path takes this much more time (or the median says as much)
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
        self.period = PERIOD  # timed batches from one steady-phase probe to the next
        self._next = 1  # the index of the next probe among the timed batches
        self._last = 0  # the index of the last probe begun

    def begin(self) -> bool:
        if self.fixed is not None:
            return self.fixed
        n = self.counts[0] + self.counts[1]
        self.on = not self.choice if self._seen >= WARMUP and self._is_probe(n) else self.choice
        self._seen += 1
        return self.on

    def _is_probe(self, n: int) -> bool:
        """Whether the n-th timed batch (from 0) is a probe: 1, 3, ..., 2 * EARLY_PROBES - 1,
        then one per `self.period` after the last."""
        return n == self._next

    def _plan(self, n: int) -> None:
        """Set the next probe after the probe n (`self.period` after it, or 2 while early)."""
        self._last = n
        self._next = n + (2 if n < 2 * EARLY_PROBES - 1 else self.period)

    def end(self, seconds: float, units: int) -> None:
        """Record the batch begun last: `seconds` of wall time for `units` of input."""
        if self.fixed is not None or self._seen <= WARMUP or units <= 0 or seconds <= 0:
            return  # pinned, a warm-up batch, or nothing measured
        n = self.counts[0] + self.counts[1]
        self.counts[int(self.on)] += 1
        probing = self._is_probe(n)
        if probing:
            self._plan(n)
        self._timed = (self._timed + [(self.on, probing, seconds / units)])[-3:]
        if len(self._timed) < 3:
            return
        (a_on, a_probe, a), (p_on, probe, p), (b_on, b_probe, b) = self._timed
        if not probe or a_probe or b_probe or a_on != b_on or p_on == a_on:
            return
        ratio = p / ((a + b) / 2)  # the probed path's time per unit / the current path's
        self.scores.append(ratio if p_on else 1.0 / ratio)
        self._decide()
        self._pace(ratio)

    def _pace(self, ratio: float) -> None:
        """After a scored probe (`ratio`: its path's time / the current path's), widen the gap to
        the next probe while both it and the median find the chosen path clearly faster, else
        go back to `PERIOD`. The early probes keep their pace."""
        if self._last < 2 * EARLY_PROBES - 1:
            return
        median = statistics.median(self.scores)  # the alternative's time / the reference's
        clear = ratio >= 1.0 + DECISIVE and (median <= 1.0 - DECISIVE if self.choice else median >= 1.0 + DECISIVE)
        self.period = min(2 * self.period, MAX_PERIOD) if clear else PERIOD
        self._next = self._last + self.period

    def _decide(self) -> None:
        median = statistics.median(self.scores)
        choice = median < 1.0 - MARGIN
        if choice != self.choice:
            log.debug("CPU forward: %s takes %.2fx the time of PyTorch's own path (median of the last %d "
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
        return (f"using {path}: {self.name} takes {statistics.median(self.scores):.2f}x PyTorch's time "
                f"(median of {len(self.scores)} probes; {self.counts[1]} of {sum(self.counts)} timed batches on {self.name})")
