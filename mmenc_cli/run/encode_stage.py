"""The encode stage: micro-batches through the encoder, each outcome to a shard or to an error row.

`BatchRunner` (`batching.py`) runs a modality's payloads in micro-batches, bisecting failed
batches and backing off on out-of-memory; this stage normalizes pooled vectors where the output
asks for it, hands every vector to the shard committer and every failure to the failure sink, and
counts both. It runs one group behind: a group's forwards are launched, then the group before it
is accounted for while the device works (on CUDA nothing waits for the device until then). It
also collects the committer's shard outcomes: a shard that could not be written turns its items
from encoded into `write.failed` error rows.
"""

from __future__ import annotations

import errno
import time
from typing import Any, Callable

from ..batching import BatchRunner, Launched
from ..encoders.base import EncodeOutput, Encoder
from ..errors import DeviceError, MMError, OutputError, RunError
from ..records import Item
from .commit import ShardCommitter, ShardOutcome
from .counters import Counters
from .failures import FailureSink


def free_device_memory() -> None:
    """Release cached accelerator memory after an out-of-memory error (best effort)."""
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # freeing memory is best effort
        pass


class EncodeStage:
    """`stage(modality, items, payloads)` encodes one group of items of one modality."""

    def __init__(self, encoder: Encoder, batch_size: int, grow_after: int, normalize: bool,
                 counters: Counters, failures: FailureSink, committer: ShardCommitter,
                 events: list[str], progress: Callable[[Counters], None]) -> None:
        self.encoder, self.batch_size = encoder, batch_size
        self.normalize = normalize and (encoder.output_kind == "pooled" or encoder.normalizes_rows)
        self.counters, self.failures, self.committer = counters, failures, committer
        self.events, self.progress = events, progress
        self.runner = BatchRunner(self._encode_fn, batch_size, grow_after=grow_after,
                                  free_memory=free_device_memory, check=encoder.check_outputs)
        #: the group launched last, accounted for when the next one is launched (or at `finish`)
        self.pending: tuple[Launched, list[Item], list[Any]] | None = None

    def _encode_fn(self, modality: str, payloads: Any) -> EncodeOutput:
        out = self.encoder.encode(modality, payloads)
        if self.normalize:
            import torch

            normalize = torch.nn.functional.normalize
            out.vectors = ([normalize(v.float(), p=2, dim=-1) for v in out.vectors] if isinstance(out.vectors, list)
                           else normalize(out.vectors.float(), p=2, dim=-1))
        return out

    def __call__(self, modality: str, items: list[Item], payloads: list[Any]) -> None:
        """Launch this group's forwards, then account for the previous group while they run: the
        device is never idle waiting for the host's bookkeeping, and the host never waits for a
        copy it could do later."""
        t0 = time.perf_counter()
        try:
            launched = self.runner.launch(modality, payloads)
        except DeviceError:  # the run ends: this group and the one before are left for a re-run
            self.counters.add(modality, "not_attempted", len(items))
            self._drop_pending()
            raise
        # grids of token outputs; a text batch may be one `TokenizedTexts`, never walked text by text
        metas = [None] * len(payloads) if modality == "text" else [payload.meta for payload in payloads]
        self.counters.add_seconds("encode", time.perf_counter() - t0)
        previous, self.pending = self.pending, (launched, items, metas)
        if previous is not None:
            try:
                self._account(*previous)
            except DeviceError:
                self._drop_pending()
                raise

    def _account(self, launched: Launched, items: list[Item], metas: list[Any]) -> None:
        """Wait for a launched group's vectors; commit them, record its failures, count both."""
        modality = launched.modality
        t0 = time.perf_counter()
        try:
            outcomes = launched.outcomes()
        except DeviceError:
            self.counters.add(modality, "not_attempted", len(items))
            raise
        finally:
            self.counters.add_seconds("encode", time.perf_counter() - t0)
        encoded = truncated = 0  # counted once a group, not once an item
        try:
            for i, (item, meta, oc) in enumerate(zip(items, metas, outcomes)):
                if oc.error is not None:
                    try:
                        self.failures.record(oc.error, item.row, modality)
                    except OutputError:  # the report cannot be written: the rest waits for a re-run
                        self.counters.add(modality, "not_attempted", len(items) - i - 1)
                        raise
                    continue
                encoded += 1
                truncated += oc.truncated or item.cut
                self.committer.add(item.row, modality, oc.value, meta)
        finally:
            self.counters.add(modality, "encoded", encoded)
            self.counters.add(modality, "truncated", truncated)
        self.events += self.runner.stats.events
        self.runner.stats.events.clear()
        self.settle(self.committer.outcomes())
        self.progress(self.counters)

    def flush(self) -> None:
        """Account for the group still in flight."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._account(*pending)

    def _drop_pending(self) -> None:
        """The group in flight is left for a re-run (the run stops as a whole)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.counters.add(pending[0].modality, "not_attempted", len(pending[1]))

    def settle(self, outcomes: list[ShardOutcome], raise_fault: bool = True) -> None:
        """Count the written shards; a shard that failed turns its items into error rows; a fault
        of the output leaves them not attempted and raises `OutputError` (the run ends)."""
        fault = None
        for oc in outcomes:
            self.counters.add_seconds("write", oc.seconds)
            if oc.fault:
                self._not_attempted(oc.shard.modalities)
                fault = fault or oc
                continue
            if oc.error is None:
                continue
            err = MMError(f"could not write shard {oc.name}: {oc.error}", stage="write", reason="write.failed",
                          error=type(oc.error).__name__)
            for row, modality in zip(oc.shard.refs, oc.shard.modalities):
                self.counters.add(modality, "encoded", -1)
                self.failures.record(err, row, modality)
        if fault is not None and raise_fault:
            raise output_fault(fault)

    def _not_attempted(self, modalities: list[str]) -> None:
        for modality in modalities:
            self.counters.add(modality, "encoded", -1)
            self.counters.add(modality, "not_attempted")

    def finish(self) -> None:
        """Account for the group in flight, commit the shard being filled and wait for every
        write; record the forward's GPU time."""
        self.flush()
        self.committer.flush()
        self.settle(self.committer.close())
        if (busy := self.encoder.device_seconds()) is not None:
            self.counters.add_seconds("forward_device", busy)  # CUDA events: the forward's GPU time

    def abandon(self) -> None:
        """After a fault of the output: the shard being filled and every shard not written are
        left for a re-run (not attempted); the writer thread stops."""
        self._drop_pending()
        self._not_attempted(self.committer.shard.modalities)
        self.committer.shard = self.committer.new_shard()
        self.settle(self.committer.close(check=False), raise_fault=False)

    def abort(self) -> None:
        """Stop the writer thread after an unexpected error (what is queued is still written)."""
        self.committer.close(check=False)


def output_fault(oc: ShardOutcome) -> RunError:
    """The run-level error of a shard that the output could not take (disk full, read-only, ...;
    or its name taken by another runner of the task: that one's own error, exit 75)."""
    exc = oc.error
    if isinstance(exc, RunError):
        return exc
    where, cause, mend = "", str(exc), "fix the store or its credentials"
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        code = errno.errorcode.get(exc.errno) if exc.errno else None
        cause = f"{exc.strerror or exc}" + (f" ({code})" if code else "")
        if exc.errno:  # a local filesystem's fault
            mend = "free the space or fix the permissions"
    return OutputError(f"cannot write shard {oc.name}{where}: {cause}; whole shards are committed, the rest is "
                       f"left for a re-run: {mend}, then run the same command")
