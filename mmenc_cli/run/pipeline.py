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
from dataclasses import replace
from typing import Any, Callable, Iterator

from ..config import RunConfig
from ..encoders.base import Encoder
from ..encoders.device_decode import jpeg_decoder
from ..errors import DeviceError, LockWaitInterrupted, MMError, OutputError
from ..idset import HashSet64, id_hash
from ..media.clips import require_av
from ..outdir import OutDir
from ..readers import iter_rows
from ..records import InvalidRow, Item, ManifestRow, NotDownloaded
from ..report import ErrorReportWriter
from ..shardlog import reconcile
from .counters import Counters, RunResult, threshold_exceeded
from .decode_pool import start_forkserver, workers_start_early
from .devices import run_devices
from .failures import FailureSink
from .media import released
from .metadata import decode_mode, fingerprint, library_versions, model_facts, resolved_dtype, write_task_meta
from .resume import History, check_commit, check_output, load_history, open_output
from .stages import Stages
from .stopping import Interrupted, interruptible

log = logging.getLogger("mmenc")

ProgressFn = Callable[[Counters], None]
EncoderFactory = Callable[..., Encoder]


class EncodeRun:
    """One task's (and one worker's) encode run. Use `run_encode`."""

    def __init__(self, cfg: RunConfig, worker: int = 0, worker_count: int = 1,
                 encoder_factory: EncoderFactory | None = None, progress: ProgressFn | None = None,
                 stop: threading.Event | None = None, primary: bool = True) -> None:
        self.cfg = cfg
        self.primary = primary  # False for a device worker: its parent holds the lock and writes task meta
        self.task = cfg.task_index
        self.worker, self.worker_count = worker, worker_count
        self.out = OutDir(cfg.writer.out)
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

    # -- setup ----------------------------------------------------------------------------
    @property
    def device(self) -> str:
        """This worker's device (one of `--device`'s list)."""
        return self.cfg.model.devices[self.worker % len(self.cfg.model.devices)]

    def run(self) -> RunResult:
        """Run the task: take its lock (unless a device worker under its parent's lock) and encode."""
        t_start = time.perf_counter()
        if not self.primary:
            return self._run_locked(t_start)
        self.out.prepare()  # exists and writable (OutputError) before taking the lock
        try:
            lock = self.out.lock(self.task, wait=self.cfg.wait_lock, stop=self.stop)
        except LockWaitInterrupted:
            return self._result("interrupted", t_start)
        with lock:
            open_output(self.out, self.cfg, self.task)
            self.out.clean_tmp(self.task)
            reconcile(self.out, self.task)
            return self._run_locked(t_start)

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
        with interruptible(self.stop):
            self.encoder = factory(self.cfg.model, device=self.device)
        self.counters.add_seconds("load", time.perf_counter() - t0)
        log.debug("model %s loaded in %.1f s", self.cfg.model.model, time.perf_counter() - t0)
        check_commit(self.out, self.cfg.model.model, self.facts or {}, self.encoder.info)
        return self.encoder

    def _init_facts(self) -> dict[str, Any]:
        """The output's facts: from its metadata when the options match, else from the loaded model."""
        dtype = resolved_dtype(self.cfg, self.device)
        if self.cfg.media.decode == "gpu":
            jpeg_decoder()  # the extra is installed, or a clear error before anything else
        if {"audio", "video"} & set(self.cfg.modalities or ()):
            require_av()  # likewise, before a model is loaded for nothing
        if self.cfg.media.decode is None:  # settled once: what the output was written with, or fast
            media = replace(self.cfg.media, decode=decode_mode(self.cfg, self.out.read_run_meta()))
            self.cfg = replace(self.cfg, media=media)
        if workers_start_early(self.cfg, self.device):  # their imports overlap the model's load
            start_forkserver(torch=True)
        fp = fingerprint(self.cfg, dtype)
        facts = check_output(self.out, fp)
        if facts is None:
            facts = model_facts(self.cfg, self.load_encoder(), dtype)
            created = self.out.create_run_meta({"fingerprint": fp, "facts": facts, "config": self.cfg.to_dict(),
                                                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                "versions": library_versions()})
            if not created:  # another task or device worker was first: its options must match ours
                facts = check_output(self.out, fp) or facts
        return facts

    def _run_locked(self, t_start: float) -> RunResult:
        if self.stop.is_set():  # stopped before starting: do not load a model for nothing, but say so
            return self._finish("interrupted", t_start)
        try:
            with interruptible(self.stop):
                self.facts = self._init_facts()
            modalities = self._modalities()
            if self.primary:
                write_task_meta(self.out, self.cfg, "running", self.counters, time.perf_counter() - t_start)
            with interruptible(self.stop):
                history = load_history(self.out)
        except Interrupted:
            return self._finish("interrupted", t_start)
        try:
            with ErrorReportWriter(self.out.error_report_path(self.task, self.worker)) as report:
                self.failures = FailureSink(report, self.counters, history.attempts, self.task, self._failed)
                self._loop(modalities, history)
        except (OutputError, DeviceError) as exc:  # a fault of the output (exit 3) or device (1) ends the run
            self._finish("failed", t_start, error=str(exc))
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, and still say so
            self._finish("interrupted", t_start)
            raise
        state = "done"
        if self.stop.is_set():
            state = "stopped" if self.stopped_by == "fail-fast" else "interrupted"
        return self._finish(state, t_start)

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
        """The run's result, recorded in the task metadata (best effort after a fault of the output)."""
        result = self._result(state, t_start)
        if self.primary:
            try:
                write_task_meta(self.out, self.cfg, state, self.counters, result.elapsed, result, error=error)
            except OutputError:
                if error is None:
                    raise
        return result

    def _result(self, state: str, t_start: float) -> RunResult:
        return RunResult(out=str(self.out.root), task=self.task, state=state, counters=self.counters,
                         facts=self.facts, elapsed=time.perf_counter() - t_start,
                         threshold_exceeded=threshold_exceeded(self.cfg, self.counters),
                         model_loaded=self.encoder is not None, events=self.events,
                         forward=self.encoder.forward_summary() if self.encoder is not None else None)

    def _failed(self) -> None:
        if self.cfg.fail_fast and self.stopped_by is None:
            self.stopped_by = "fail-fast"
            self.stop.set()

    # -- the loop -------------------------------------------------------------------------
    def _rows(self) -> Iterator[ManifestRow | InvalidRow | NotDownloaded]:
        it = iter_rows(list(self.cfg.manifests), self.cfg.manifest, self.task, self.cfg.task_count)
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
        stages = Stages(self)
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
                    if id_hash(rec.manifest, rec.locator) in history.invalid:  # repaired since
                        self.failures.resolve_line(rec)  # type: ignore[union-attr]
                    self._request(rec, modalities, history, stages)
                stages.pump()
            stages.finish(interrupted=self.stop.is_set())
        except Interrupted:  # a stop request while the model loaded or a window was tokenized
            stages.finish(interrupted=True)
        except (OutputError, DeviceError):  # a fault of the output or device: the rest is left for a re-run
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
        elif not len(history.committed) or (where := history.duplicate_of(rec, self.cfg.manifest)) is None:
            return None
        elif history.retries(rec, modalities):
            return None
        else:
            where = f"the row at {where}"
        return InvalidRow(rec.manifest, rec.line, rec.offset, id=rec.id, key=rec.key, error=MMError(
            f"id {rec.id!r} is already used in this output by {where}: ids must be unique within an output",
            stage="validate", reason="manifest.duplicate_id"))

    def _request(self, rec: ManifestRow, modalities: tuple[str, ...], history: History, stages: "Stages") -> None:
        """Count one valid row's items and hand those not settled earlier to their feeds."""
        present = 0
        row = released(rec)  # each item carries its own inline bytes, dropped once sent to decode
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
            if id_hash(rec.id, modality) in history.done:
                self.counters.add(modality, "encoded_before")
            elif id_hash(rec.id, modality, rec.manifest) in history.failed:
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
