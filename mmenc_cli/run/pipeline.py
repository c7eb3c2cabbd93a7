"""Wiring the stages: manifest rows -> items -> decode workers / text windows -> micro-batches -> shards.

`run_encode(cfg)` is the whole `mmenc encode` for one task (one process per device when several
are given, `devices.py`). It never raises for a bad item: every requested item ends as an
embedding in a committed shard or as one row in the error report (`failures.py`), or, when the
run stops as a whole, as "not attempted" for a re-run to finish. It raises only `RunError`s
(`OutputError`, `DeviceError`, `LockBusy`, `ModelLoadError`, `ConfigError`, `ManifestError`).

One run, in order: take the task's lock (`locks.py`); check the options against the output's
fingerprint or record them (`metadata.py`, `resume.py`); read what earlier runs settled; then
for each row of this task's slice (`readers/`): count it, skip what is done, and hand each
requested (row, modality) to its feed (`media.py` for images, audio and video, `texts.py`), which calls the encode stage
(`stage.py`) with batches; the stage's vectors go to the shard committer (`commit.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterator

from ..config import RunConfig
from ..encoders.base import Encoder
from .early_tokens import EarlyTokens
from ..errors import DeviceError, LockBusy, LockWaitInterrupted, MMError, OutputError, RunError
from ..idset import HashSet64, id_hash
from ..media.clips import require_av
from ..output.history import History
from ..output.task import TaskOutput, TaskRequest, open_task
from ..readers import Reading, iter_rows, preflight, record_has_id
from ..readers.registry import Source
from ..records import InvalidRow, Item, ManifestRow, NotDownloaded
from ..stopping import Interrupted, interruptible
from .admission import RunAdmission, check_commit
from .context import RunContext
from .counters import Counters, RunResult, threshold_exceeded
from .devices import run_devices
from .failures import FailureSink
from .media_feed import released
from .metadata import task_record
from .model_identity import is_demo
from .stages import Stages

log = logging.getLogger("mmenc")

ProgressFn = Callable[[Counters], None]
EncoderFactory = Callable[..., Encoder]

#: seconds between two snapshots of the running task's record, which each shard commit writes
RECORD_EVERY = 5.0


class EncodeRun:
    """One task's (and one worker's) encode run. Use `run_encode`."""

    def __init__(self, cfg: RunConfig, worker: int = 0, worker_count: int = 1,
                 encoder_factory: EncoderFactory | None = None, progress: ProgressFn | None = None,
                 stop: threading.Event | None = None, primary: bool = True) -> None:
        self.cfg = cfg
        self.primary = primary  # False for a device worker: its parent holds the lock and writes task meta
        self.task = cfg.task_index
        self.worker, self.worker_count = worker, worker_count
        self.output: TaskOutput | None = None
        self.encoder_factory = encoder_factory
        self.progress = progress or (lambda c: None)
        self.stop = stop or threading.Event()
        self.counters = Counters()
        self.encoder: Encoder | None = None
        self.facts: dict[str, Any] = {}
        self.unasked_video = False  # the model could encode video this run was not asked for (a hint, once)
        self.modalities: tuple[str, ...] = ()  # what this run encodes, settled at its start
        self.events: list[str] = []
        self.failures: FailureSink | None = None
        self.stopped_by: str | None = None
        self.context: RunContext | None = None  # what the stages share, once the loop runs
        self.early: EarlyTokens | None = None  # texts tokenized while the model loads
        self.sources: list[Source] | None = None  # the inputs, planned and checked before the task opens
        self.t_start = time.perf_counter()
        self.running: dict[str, Any] | None = None  # the running task's record, as the last snapshot took it
        self.snapped = float("-inf")

    # -- setup ----------------------------------------------------------------------------
    @property
    def device(self) -> str:
        """This worker's device (one of `--device`'s list)."""
        return self.cfg.model.devices[self.worker % len(self.cfg.model.devices)]

    def run(self) -> RunResult:
        """Run the task: open it on the output (its lock: a device worker's own under its
        parent's), encode, close it. Texts may be tokenized early meanwhile (`early_tokens.py`)."""
        if self.encoder_factory is None and self.primary and self.worker_count == 1:
            self.early = EarlyTokens.start(self.cfg)
        try:
            return self._run()
        finally:
            if self.early is not None:
                self.early.close()

    def _run(self) -> RunResult:
        t_start = self.t_start = time.perf_counter()
        # inputs checked before anything is written or a model loaded for nothing (exit 3)
        self.sources = preflight(self.cfg.manifests, self.cfg.manifest)
        admission = RunAdmission(self.cfg, self.device, self.load_encoder)
        try:
            self.output = open_task(self._task_request(t_start, admission))
        except LockWaitInterrupted:
            return self._result("interrupted", t_start)
        self.cfg, self.facts = admission.cfg, self.output.facts
        if self.output.interrupted:  # stopped before it was ready: no model loaded for nothing, but said so
            return self._finish("interrupted", t_start)
        try:
            modalities = self._modalities()
            assert self.output.report is not None
            self.failures = FailureSink(self.output, self.counters, self.output.history.attempts, self.task,
                                        self._failed)
            self._loop(modalities, self.output.history)
        except LockBusy:  # another runner of this task committed first: it owns the task's record and rows
            self.output.close(None, best_effort=True, lost=True)
            raise
        except RunError as exc:  # a fault of the output (exit 3), the device (1), the inputs or the model
            if self.counters.rows == 0:  # before its first row: the run leaves nothing (`TaskOutput.close`)
                self.output.close(None, best_effort=True, refused=True)
            else:
                self._finish("failed", t_start, error=str(exc))
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, and still say so
            self._finish("interrupted", t_start)
            raise
        except BaseException:  # a bug: the task stays "running" with no live lock, which status calls crashed
            self.output.close(None, best_effort=True)
            raise
        state = "done"
        if self.stop.is_set():
            state = "stopped" if self.stopped_by == "fail-fast" else "interrupted"
        return self._finish(state, t_start)

    def _task_request(self, t_start: float, admission: RunAdmission) -> TaskRequest:
        """What opening this run's task on its output needs."""
        cfg = self.cfg
        return TaskRequest(root=cfg.writer.out, task=self.task, worker=self.worker,
                           role="task" if self.primary else "device", overwrite=cfg.overwrite and self.primary,
                           wait_lock=cfg.wait_lock, stop=self.stop, admission=admission,
                           meta=lambda: self.running or task_record(self.cfg, "running", self.counters,
                                                                    time.perf_counter() - t_start),
                           storage_options=cfg.writer.store_options, single_writer=cfg.writer.single_writer)

    def load_encoder(self) -> Encoder:
        """The encoder, loaded on first use (a finished re-run never loads it)."""
        if self.encoder is not None:
            return self.encoder
        t0 = time.perf_counter()  # the load includes importing torch and transformers (~2.5 s)
        factory = self.encoder_factory
        if factory is None:
            from transformers.utils import logging as hf_logging

            from ..encoders import load_encoder as factory

            hf_logging.disable_progress_bar()  # no "Loading weights" bars in cron and Slurm logs
        if is_demo(self.cfg.model.model):
            log.warning("using the bundled DEMO model %s (random weights, meaningless embeddings; pass --model "
                        "for real ones)", self.cfg.model.model)
        with interruptible(self.stop):
            self.encoder = factory(self.cfg.model, device=self.device)
        if self.early is not None and not self.encoder.use_early_tokens(self.early):
            self.early.release()  # the child's core and what it sent go back at once
        self.counters.add_seconds("load", time.perf_counter() - t0)
        log.debug("model %s loaded in %.1f s", self.cfg.model.model, time.perf_counter() - t0)
        check_commit(self.cfg.writer.out, self.cfg.model.model, self.facts or {}, self.encoder.info)
        return self.encoder

    def _modalities(self) -> tuple[str, ...]:
        """The modalities this run encodes: those asked, else all the output's model has a tower for
        (video, which an image model encodes frame by frame, only when asked). Audio or video asked
        without PyAV installed stops here (exit 3)."""
        facts = self.facts
        towers = [m for m in facts["modalities"] if m != "video"] or facts["modalities"]  # video alone: frames
        modalities = tuple(self.cfg.modalities or towers)
        missing = [m for m in modalities if m not in facts["modalities"]]
        if missing:
            raise OutputError(f"model {self.cfg.model.model} cannot encode {', '.join(missing)} "
                              f"(it supports: {', '.join(facts['modalities'])})")
        if {"audio", "video"} & set(modalities):
            require_av()
        self.unasked_video = "video" in facts["modalities"] and "video" not in modalities
        self.modalities = modalities
        return modalities

    def _finish(self, state: str, t_start: float, error: str | None = None) -> RunResult:
        """The run's result, recorded as the task's state when the task closes (best effort after a
        fault of the output)."""
        result = self._result(state, t_start)
        if self.output is not None:
            record = task_record(self.cfg, state, self.counters, result.elapsed, result, error=error)
            self.output.close(record if self.primary else None, best_effort=error is not None)
        return result

    def _result(self, state: str, t_start: float) -> RunResult:
        root = self.output.root if self.output is not None else self.cfg.writer.out
        return RunResult(out=root, task=self.task, state=state,
                         counters=self.counters, facts=self.facts, elapsed=time.perf_counter() - t_start,
                         threshold_exceeded=threshold_exceeded(self.cfg, self.counters),
                         model_loaded=self.encoder is not None, events=self.events,
                         forward=self.encoder.forward_summary() if self.encoder is not None else None,
                         batch_size=self.context.batch_size if self.context is not None else None)

    def _report(self, counters: Counters) -> None:
        """The progress callback of the stages (the loop's thread): the caller's display, and a
        snapshot of the running task's record, with its progress, that the next shard commit
        writes (`mmenc status` shows how far a running task is); the writer thread only reads it."""
        self.progress(counters)
        if time.monotonic() - self.snapped >= RECORD_EVERY:
            self._snapshot()

    def _snapshot(self) -> None:
        """The running task's record now (on the loop's thread, the counters' owner)."""
        self.snapped = time.monotonic()
        self.running = task_record(self.cfg, "running", self.counters, time.perf_counter() - self.t_start)

    def _failed(self) -> None:
        if self.cfg.fail_fast and self.stopped_by is None:
            self.stopped_by = "fail-fast"
            self.stop.set()

    # -- the loop -------------------------------------------------------------------------
    def _rows(self) -> Iterator[ManifestRow | InvalidRow | NotDownloaded]:
        reading = Reading()  # the reader moves it as it reads: the progress's percentage
        it = iter_rows(list(self.cfg.manifests), self.cfg.manifest, self.task, self.cfg.task_count, reading,
                       sources=self.sources)
        self.counters.reading = reading
        index = 0
        while True:
            t0 = time.perf_counter()
            try:
                rec = next(it)
            except StopIteration:
                return
            finally:
                self.counters.add_seconds("read", time.perf_counter() - t0)
            if self.worker_count > 1:
                index += 1
                # rows of one id go to one worker, so its `seen` set catches duplicate ids (409)
                owner = (id_hash(rec.id) if isinstance(rec, ManifestRow) else index) % self.worker_count
                if owner != self.worker:
                    continue
            yield rec

    def _loop(self, modalities: tuple[str, ...], history: History) -> None:
        seen = HashSet64()
        assert self.output is not None and self.failures is not None
        self.context = RunContext(self.cfg, self.output, self.counters, self.failures, self.stop, self._report,
                                  self.load_encoder, self.facts, modalities, self.events)
        self._snapshot()  # before the writer thread may commit a shard and ask for it
        stages = Stages(self.context)
        try:
            for rec in self._rows():
                if self.stop.is_set():
                    break
                self.counters.add_row("rows")
                if isinstance(rec, NotDownloaded):
                    self.counters.add_row("not_downloaded")
                elif isinstance(rec, InvalidRow):
                    self._invalid(rec, history)
                elif (duplicate := self._duplicate(rec, seen, history, modalities)) is not None:
                    self._invalid(duplicate, history)
                else:
                    if len(history.invalid) and id_hash(rec.manifest, rec.locator) in history.invalid:  # repaired
                        self.failures.resolve_line(rec)  # type: ignore[union-attr]
                    self._request(rec, modalities, history, stages)
                stages.pump()
            stages.finish(interrupted=self.stop.is_set())
        except Interrupted:  # a stop request while the model loaded or a window was tokenized
            stages.finish(interrupted=True)
        except (OutputError, DeviceError, LockBusy):  # the output, the device or another runner: the rest waits
            self.stop.set()
            stages.abandon()
            raise
        except BaseException:
            stages.abort()
            raise

    def _duplicate(self, rec: ManifestRow, seen: HashSet64, history: History,
                   modalities: tuple[str, ...]) -> InvalidRow | None:
        """A 409 row when `rec`'s id is taken: by an earlier row of this run, or committed from
        another row (another task's, or an earlier run's with another input) unless `rec` only
        retries items of that id that failed and are not encoded (a row `errors retry` wrote)."""
        if not seen.add(id_hash(rec.id)):
            where = "an earlier row of this run"
        elif not len(history.committed) or (where := history.duplicate_of(rec, self._holds)) is None:
            return None
        elif history.retries(rec, modalities):
            return None
        else:
            where = f"the row at {where}"
        return InvalidRow(rec.manifest, rec.line, rec.offset, id=rec.id, key=rec.key, error=MMError(
            f"id {rec.id!r} is already used in this output by {where}: ids must be unique within an output",
            stage="validate", reason="manifest.duplicate_id"))

    def _holds(self, manifest: str, offset: int, row_id: str) -> bool:
        return record_has_id(manifest, offset, row_id, self.cfg.manifest)

    def _request(self, rec: ManifestRow, modalities: tuple[str, ...], history: History, stages: "Stages") -> None:
        """Count one valid row's items and hand those not settled earlier to their feeds."""
        present = 0
        # each item carries its own inline bytes, dropped once sent to decode
        row = rec if rec.image is None and rec.audio is None and rec.video is None else released(rec)
        if self.unasked_video and rec.video is not None:
            self.unasked_video = False  # said once
            log.warning("rows hold video clips, which this run does not encode: pass --modality %s,video "
                        "to encode them (frames through the image tower)", ",".join(modalities))
        for modality in modalities:
            if rec.value(modality) is None:
                self.counters.add(modality, "skipped")
                continue
            present += 1
            self.counters.add(modality, "requested")
            # a first run has no history: nothing to hash
            if len(history.done) and id_hash(rec.id, modality) in history.done:
                self.counters.add(modality, "encoded_before")
            elif len(history.failed) and id_hash(rec.id, modality, rec.manifest) in history.failed:
                self.counters.add(modality, "failed_before")
            else:
                stages.add(Item(row, modality, source=rec.value(modality)))
        if not present:
            self.counters.add_row("rows_skipped")

    def _invalid(self, inv: InvalidRow, history: History) -> None:
        if id_hash(inv.manifest, inv.locator) in history.invalid:
            self.counters.add_row("invalid_before")
        else:
            assert self.failures is not None
            self.failures.record_invalid(inv)


def run_encode(cfg: RunConfig, *, encoder_factory: EncoderFactory | None = None,
               progress: ProgressFn | None = None, stop: threading.Event | None = None) -> RunResult:
    """Run `mmenc encode` for one task (one process per device when several are given)."""
    stop = stop or threading.Event()
    if len(cfg.model.devices) > 1 and encoder_factory is None:
        return run_devices(cfg, EncodeRun, progress, stop)
    return EncodeRun(cfg, encoder_factory=encoder_factory, progress=progress, stop=stop).run()
