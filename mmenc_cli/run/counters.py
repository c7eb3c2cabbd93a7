"""What a run counts, with one owner: only the encode loop's thread changes the counters.

Every item the run is asked for ends in exactly one bucket, so that
`requested + invalid lines = encoded + failed + not attempted` holds for every run; the CLI treats
a run where it does not as an internal error. "Earlier" buckets hold what earlier runs of the same
output already settled (encoded into committed shards, or failed permanently). Items a run
accepted but never finished because it stopped as a whole (a signal, --fail-fast) are "not
attempted": a re-run encodes them.

Other threads (the shard writer, the tokenize-ahead thread) never touch the counters: they hand
their results to the encode loop, which counts them. `Counters` checks this on every change.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..config import RunConfig
    from ..readers.slicing import Reading

#: per-stage seconds the summary and the task metadata report
STAGES = ("load", "read", "decode", "tokenize", "encode", "write")


@dataclass
class ModalityStats:
    """Per-modality outcome counts of one run."""

    requested: int = 0
    encoded: int = 0
    encoded_before: int = 0
    failed: dict[int, int] = field(default_factory=dict)
    failed_before: int = 0
    skipped: int = 0
    truncated: int = 0
    not_attempted: int = 0

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())


@dataclass
class Counters:
    """Everything the summary and the run metadata count (see the module docstring)."""

    rows: int = 0
    invalid: int = 0
    invalid_before: int = 0
    rows_skipped: int = 0
    not_downloaded: int = 0  # img2dataset metadata rows whose download failed: no item, counted apart
    modalities: dict[str, ModalityStats] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    owner: int | None = field(default=None, repr=False, compare=False)
    #: how far the reader is in the task's slice (`readers.Reading`, moved by the reader on the loop's thread)
    reading: "Reading | None" = field(default=None, compare=False)

    # -- changes: the encode loop's thread only

    def _touch(self) -> None:
        """Refuse a change from any thread but the owner (the first thread that changes them)."""
        me = threading.get_ident()
        if self.owner is None:
            self.owner = me
        elif self.owner != me:
            raise RuntimeError(f"counters changed from thread {threading.current_thread().name!r}, "
                               "not the encode loop's")

    def mod(self, modality: str) -> ModalityStats:
        """The stats of one modality (read-only use; change them through the methods below)."""
        return self.modalities.setdefault(modality, ModalityStats())

    def add(self, modality: str, name: str, n: int = 1) -> None:
        """Add `n` to one per-modality count (`requested`, `encoded`, `skipped`, ...)."""
        self._touch()
        stats = self.mod(modality)
        setattr(stats, name, getattr(stats, name) + n)

    def add_failure(self, modality: str, code: int) -> None:
        """Count one failed item of `modality` under its HTTP-style code."""
        self._touch()
        failed = self.mod(modality).failed
        failed[code] = failed.get(code, 0) + 1

    def add_row(self, name: str, n: int = 1) -> None:
        """Add `n` to a per-row count (`rows`, `invalid`, `invalid_before`, `rows_skipped`, `not_downloaded`)."""
        self._touch()
        setattr(self, name, getattr(self, name) + n)

    def add_seconds(self, stage: str, seconds: float) -> None:
        """Add time spent in one stage (`STAGES`, plus e.g. `forward_device`)."""
        self._touch()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    def merge(self, other: "Counters") -> None:
        """Add another worker's counts into these."""
        for name in ("rows", "invalid", "invalid_before", "rows_skipped", "not_downloaded"):
            self.add_row(name, getattr(other, name))
        for stage, secs in other.seconds.items():
            self.add_seconds(stage, secs)
        self._merge_reading(other.reading)
        for modality, o in other.modalities.items():
            for name in ("requested", "encoded", "encoded_before", "failed_before", "skipped", "truncated",
                         "not_attempted"):
                self.add(modality, name, getattr(o, name))
            for code, n in o.failed.items():
                failed = self.mod(modality).failed
                failed[code] = failed.get(code, 0) + n

    def _merge_reading(self, other: "Reading | None") -> None:
        """Sum the slices' sizes and positions (tasks of one job); unknown once one is unknown."""
        mine = self.reading
        if other is None or (mine is not None and mine.total is None):
            return
        if mine is None:
            self.reading = replace(other)
        elif other.total is None or other.unit != mine.unit:
            mine.total = None
        else:
            mine.total, mine.done = mine.total + other.total, mine.done + other.done

    # -- totals

    @property
    def requested(self) -> int:
        return sum(m.requested for m in self.modalities.values())

    @property
    def encoded(self) -> int:
        return sum(m.encoded + m.encoded_before for m in self.modalities.values())

    @property
    def encoded_now(self) -> int:
        return sum(m.encoded for m in self.modalities.values())

    @property
    def failed(self) -> int:
        return sum(m.failed_total + m.failed_before for m in self.modalities.values()) + self.invalid + self.invalid_before

    @property
    def failed_now(self) -> int:
        return sum(m.failed_total for m in self.modalities.values()) + self.invalid

    @property
    def not_attempted(self) -> int:
        return sum(m.not_attempted for m in self.modalities.values())

    @property
    def skipped(self) -> int:
        return sum(m.skipped for m in self.modalities.values())

    @property
    def balanced(self) -> bool:
        """items requested + invalid lines == encoded + failed + not attempted."""
        return self.requested + self.invalid + self.invalid_before == self.encoded + self.failed + self.not_attempted

    @property
    def progress(self) -> dict[str, Any] | None:
        """How far the task is, `{done, total, unit}`: the part of its slice read, times the share
        of the items read so far that are settled (encoded, failed, left for a re-run), so that
        items read but still in flight do not count as done and 100% means all settled. None
        when the slice's size is not known."""
        r = self.reading
        if r is None or r.total is None:
            return None
        requested = self.requested
        settled = self.encoded + self.failed + self.not_attempted - self.invalid - self.invalid_before
        done = r.done * min(settled, requested) // requested if requested else r.done
        return {"done": min(done, r.total), "total": r.total, "unit": r.unit}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy, totals included."""
        d: dict[str, Any] = {name: getattr(self, name) for name in ("rows", "invalid", "invalid_before", "rows_skipped", "not_downloaded")}
        d["modalities"] = {m: {**vars(s), "failed": dict(s.failed)} for m, s in self.modalities.items()}
        d["seconds"] = dict(self.seconds)
        d.update(requested=self.requested, encoded=self.encoded, failed=self.failed,
                 not_attempted=self.not_attempted, balanced=self.balanced)
        return d


def threshold_exceeded(cfg: "RunConfig", c: Counters) -> str | None:
    """Why the run exceeded --max-errors / --max-error-rate, or None."""
    failed = c.failed
    if cfg.max_errors is not None and failed > cfg.max_errors:
        return f"{failed} errors > --max-errors {cfg.max_errors}"
    total = c.requested + c.invalid + c.invalid_before
    if cfg.max_error_rate is not None and total and failed / total > cfg.max_error_rate:
        return f"error rate {failed / total:.2%} > --max-error-rate {cfg.max_error_rate:.2%}"
    return None


@dataclass
class RunResult:
    """What one run did; the CLI turns it into a summary and an exit code."""

    out: str
    task: int
    state: str  # "done", "interrupted", "stopped" (fail-fast)
    counters: Counters
    facts: dict[str, Any]
    elapsed: float
    threshold_exceeded: str | None = None
    signal: int | None = None
    model_loaded: bool = False
    events: list[str] = field(default_factory=list)
    forward: dict[str, Any] | None = None  # how the forward ran (the CPU path), where the model loaded
    batch_size: int | None = None  # the batch size the run used (--batch-size, or the device's probe)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy (the `--json` result of `mmenc encode`, less the exit status)."""
        return {"out": self.out, "task": self.task, "state": self.state, "elapsed": round(self.elapsed, 3),
                "counters": self.counters.to_dict(), "threshold_exceeded": self.threshold_exceeded,
                "model_loaded": self.model_loaded, "forward": self.forward, "batch_size": self.batch_size,
                "events": self.events[-50:]}
