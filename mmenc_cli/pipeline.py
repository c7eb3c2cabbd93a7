"""Wiring the stages: manifest rows -> items -> decode workers -> micro-batches -> shards.

`run_encode(cfg)` is the whole `mmenc encode` for one task (and one worker/device). It never
raises for a bad item: every requested item ends as an embedding in a committed shard or as one
row in the error report. It raises only for run-level problems (`OutputError`, `LockBusy`,
`ModelLoadError`, `ConfigError`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import platform
import queue
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from . import __version__
from .config import ConfigError, RunConfig
from .errors import ErrorRecord, ErrorReportWriter, MMError, classify, iter_error_records
from .idset import AttemptCounts, HashSet64, id_hash
from .outdir import OutDir, OutputError, TaskLock, iter_shard_keys, read_json
from .records import MODALITIES, InvalidRow, Item, ManifestRow

log = logging.getLogger("mmenc")
#: texts collected before they are sorted by length and cut into batches; bounded (the rows, their
#: strings and token ids of at most this many texts), large enough that the batches pad little (tokens computed / real tokens on the benchmark corpus, batches of 32:
#: windows of 4096 1.036, 8192 1.024, 16384 ~1.01; sentence-transformers' sort of all texts by
#: characters 1.109)
TEXT_WINDOW = 16384


def tokenize_ahead(device: str) -> bool:
    """Whether the next window of texts is tokenized on a background thread while the current
    one is encoded: on an accelerator, whose forward leaves the CPU cores idle; not on the CPU,
    where the forward's streams already keep every core busy. `MMENC_TOKENIZE_AHEAD=1|0` forces it."""
    want = os.environ.get("MMENC_TOKENIZE_AHEAD", "").strip()
    if want in ("0", "1"):
        return want == "1"
    return not str(device).startswith("cpu")

RETRYABLE_CODES = frozenset({503, 504})
#: options that change the vectors or the output's schema: a run must match the output's
FINGERPRINT_KEYS = ("model", "model_stamp", "revision", "pooling", "dtype", "normalize", "text_prefix",
                    "max_length", "format", "out_dtype", "keep")


# ------------------------------------------------------------------------------------------
# Counters and results


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

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())


@dataclass
class Counters:
    """Everything the summary and the run metadata count."""

    rows: int = 0
    invalid: int = 0
    invalid_before: int = 0
    rows_skipped: int = 0
    modalities: dict[str, ModalityStats] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: {"read": 0.0, "decode": 0.0, "tokenize": 0.0, "encode": 0.0, "write": 0.0})

    def mod(self, modality: str) -> ModalityStats:
        return self.modalities.setdefault(modality, ModalityStats())

    @property
    def requested(self) -> int:
        return sum(m.requested for m in self.modalities.values())

    @property
    def encoded(self) -> int:
        return sum(m.encoded + m.encoded_before for m in self.modalities.values())

    @property
    def failed(self) -> int:
        return sum(m.failed_total + m.failed_before for m in self.modalities.values()) + self.invalid + self.invalid_before

    @property
    def failed_now(self) -> int:
        return sum(m.failed_total for m in self.modalities.values()) + self.invalid

    @property
    def balanced(self) -> bool:
        """items requested + invalid lines == encoded + failed."""
        return self.requested + self.invalid + self.invalid_before == self.encoded + self.failed

    def merge(self, other: "Counters") -> None:
        """Add another worker's counts into these."""
        for name in ("rows", "invalid", "invalid_before", "rows_skipped"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v
        for mod, o in other.modalities.items():
            m = self.mod(mod)
            for name in ("requested", "encoded", "encoded_before", "failed_before", "skipped", "truncated"):
                setattr(m, name, getattr(m, name) + getattr(o, name))
            for code, n in o.failed.items():
                m.failed[code] = m.failed.get(code, 0) + n

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(requested=self.requested, encoded=self.encoded, failed=self.failed, balanced=self.balanced)
        return d


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


# ------------------------------------------------------------------------------------------
# Fingerprint and metadata


def model_stamp(model: str) -> str | None:
    """For a local model folder: a hash of its config and weight file sizes (None for hub ids)."""
    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        p = path / name
        if name.endswith(".json") and p.is_file() and p.stat().st_size < 1 << 20:
            h.update(name.encode() + p.read_bytes())
        elif name.endswith((".safetensors", ".bin")):
            h.update(f"{name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def fingerprint(cfg: RunConfig, dtype: str) -> dict[str, Any]:
    """The options that change the vectors or schema, with the dtype already resolved."""
    m = cfg.model
    path = Path(m.model).expanduser()
    return {
        "model": str(path.resolve()) if path.is_dir() else m.model,
        "model_stamp": model_stamp(m.model),
        "revision": m.revision,
        "pooling": m.pooling,
        "dtype": dtype,
        "normalize": m.normalize,
        "text_prefix": m.text_prefix,
        "max_length": m.max_length,
        "format": cfg.writer.format,
        "out_dtype": cfg.writer.out_dtype,
        "keep": list(cfg.manifest.keep),
    }


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints."""
    return [f"{k}: output has {old.get(k)!r}, this run {new.get(k)!r}" for k in FINGERPRINT_KEYS if old.get(k) != new.get(k)]


def resolved_dtype(cfg: RunConfig) -> str:
    """The compute dtype name this run will use (imports torch only to resolve an 'auto' device)."""
    dtype, device = cfg.model.dtype, cfg.model.devices[0]
    if dtype != "auto":
        return dtype
    if device in ("cpu", "mps"):
        return "float32"
    from .encoders.device import resolve_device, resolve_dtype

    return str(resolve_dtype("auto", resolve_device(device))).replace("torch.", "")


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape the vectors, for the run metadata."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"mmenc": __version__, "python": platform.python_version()}
    for name in ("torch", "transformers", "pillow", "pyarrow", "safetensors", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


# ------------------------------------------------------------------------------------------
# The run


def open_output(out: OutDir, cfg: RunConfig, task: int) -> None:
    """Under this task's lock: refuse --overwrite while other tasks run, wipe OUT (not its locks), prepare."""
    if cfg.overwrite:
        busy = [p.name for p in sorted((out.meta / "locks").glob("task-*.lock"))
                if p != out.lock_path(task) and TaskLock(p).is_held()]
        if busy:
            raise OutputError(f"--overwrite: other runs are writing {out.root} ({', '.join(busy)})")
        out.wipe()
        out.prepare()


def threshold(cfg: RunConfig, c: Counters) -> str | None:
    """Why the run exceeded --max-errors / --max-error-rate, or None."""
    failed = c.failed
    if cfg.max_errors is not None and failed > cfg.max_errors:
        return f"{failed} errors > --max-errors {cfg.max_errors}"
    total = c.requested + c.invalid + c.invalid_before
    if cfg.max_error_rate is not None and total and failed / total > cfg.max_error_rate:
        return f"error rate {failed / total:.2%} > --max-error-rate {cfg.max_error_rate:.2%}"
    return None


def write_task_meta(out: OutDir, cfg: RunConfig, state: str, counters: Counters, elapsed: float,
                    result: RunResult | None = None) -> None:
    """Record this task's state, counts, timings and versions under `_mmenc/tasks/`."""
    path = out.task_meta_path(cfg.task_index)
    data = {"task": cfg.task_index, "task_count": cfg.task_count, "state": state, "host": platform.node(),
            "pid": os.getpid(), "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "manifests": list(cfg.manifests),
            "devices": list(cfg.model.devices), "counters": counters.to_dict(), "elapsed": elapsed,
            "versions": library_versions(), "config": cfg.to_dict(),
            "threshold_exceeded": result.threshold_exceeded if result else None,
            "model_loaded": result.model_loaded if result else None,
            "events": (result.events if result else [])[-50:]}
    previous = read_json(path)
    if state == "running" and isinstance(previous, dict):
        data["previous_state"] = previous.get("state")
    out.write_task_meta(cfg.task_index, data)


ProgressFn = Callable[[Counters], None]


class EncodeRun:
    """One task's (and one worker's) encode run. Use `run_encode`."""

    def __init__(self, cfg: RunConfig, worker: int = 0, worker_count: int = 1,
                 encoder_factory: Callable[..., Any] | None = None, progress: ProgressFn | None = None,
                 stop: threading.Event | None = None, primary: bool = True) -> None:
        self.cfg = cfg
        self.primary = primary  # False for a device worker: its parent holds the lock and writes task meta
        self.task = cfg.task_index
        self.worker = worker
        self.worker_count = worker_count
        self.out = OutDir(cfg.writer.out)
        self.encoder_factory = encoder_factory
        self.progress = progress or (lambda c: None)
        self.stop = stop or threading.Event()
        self.counters = Counters()
        self.encoder: Any = None
        self.facts: dict[str, Any] = {}
        self.events: list[str] = []
        self._errors: ErrorReportWriter | None = None
        self._errors_lock = threading.Lock()
        self._attempts = AttemptCounts()  # ~12 bytes per earlier failure, no Python object each
        self._stopped_by: str | None = None

    # -- setup ----------------------------------------------------------------------------
    def _check_output(self, fp: dict[str, Any]) -> dict[str, Any] | None:
        """Compare with the output's recorded fingerprint; return its facts when they match."""
        meta = self.out.read_run_meta()
        if meta is None:
            if self.out.shards():
                raise OutputError(f"{self.out.root} holds shards but no {self.out.run_meta_path.name}: "
                                  "not an mmenc output, or damaged; use --overwrite to start over")
            return None
        diff = fingerprint_diff(meta.get("fingerprint", {}), fp)
        if diff:
            raise OutputError(f"{self.out.root} was written with other options ({'; '.join(diff)}); "
                              "use the same options, another --out, or --overwrite to start over")
        return meta.get("facts")

    def _load_encoder(self) -> None:
        if self.encoder is not None:
            return
        t0 = time.perf_counter()  # the load includes importing torch and transformers (~2.5 s)
        factory = self.encoder_factory
        if factory is None:
            from transformers.utils import logging as hf_logging

            from .encoders import load_encoder as factory

            hf_logging.disable_progress_bar()  # no "Loading weights" bars in cron and Slurm logs
        device = self.cfg.model.devices[self.worker % len(self.cfg.model.devices)]
        self.encoder = factory(self.cfg.model, device=device)
        log.info("model %s loaded in %.1f s", self.cfg.model.model, time.perf_counter() - t0)
        # a hub id's fingerprint names the requested revision ("main" moves): the commit the model
        # actually came from must be the one the output was started with, or vectors would mix
        was = (self.facts or {}).get("commit")
        now = (getattr(self.encoder, "info", None) or {}).get("commit")
        if was and now and was != now:
            raise OutputError(f"{self.cfg.model.model} now resolves to commit {now}, but {self.out.root} was "
                              f"written with commit {was}: pin --revision {was}, use another --out, or "
                              "--overwrite to start over")

    def _facts_from_encoder(self, dtype: str) -> dict[str, Any]:
        enc = self.encoder
        info = dict(getattr(enc, "info", {}) or {})
        normalize = self.cfg.model.normalize
        if normalize is None:
            normalize = bool(enc.default_normalize)
        out_dtype = self.cfg.writer.out_dtype or ("float16" if enc.output_kind == "tokens" else "float32")
        stamp = model_stamp(self.cfg.model.model)
        revision = info.get("commit") or info.get("revision") or (f"local:{stamp}" if stamp else None)
        return {**info, "model": self.cfg.model.model, "revision": revision, "dim": int(enc.dim),
                "modalities": sorted(enc.modalities), "normalize": normalize, "dtype": dtype,
                "pooling": info.get("pooling", self.cfg.model.pooling),
                "out_dtype": out_dtype, "output_kind": enc.output_kind, "mmenc_version": __version__}

    def _load_history(self) -> tuple[HashSet64, HashSet64, HashSet64]:
        """Done items (committed shards), earlier permanent failures, earlier invalid lines."""
        import numpy as np

        parts = [np.fromiter((id_hash(i, m) for i, m in zip(ids, mods)), dtype=np.uint64, count=len(ids))
                 for _shard, ids, mods in iter_shard_keys(self.out)]
        done = HashSet64(np.concatenate(parts) if parts else np.zeros(0, np.uint64))  # one sort, not one per shard
        failed, invalid = HashSet64(), HashSet64()
        for row in iter_error_records(self.out.error_report_paths()):
            if row.get("status") != "failed":
                continue
            if row.get("modality") is None:
                invalid.add(id_hash(row.get("manifest"), str(row.get("offset"))))
                continue
            key = id_hash(row.get("id"), row.get("modality"))
            self._attempts.add(key, int(row.get("attempt") or 1))
            if int(row.get("code") or 500) not in RETRYABLE_CODES:
                failed.add(id_hash(row.get("id"), row.get("modality"), row.get("manifest")))
        self._attempts.freeze()
        return done, failed, invalid

    # -- error rows -----------------------------------------------------------------------
    def _record(self, err: MMError, *, row: ManifestRow | None = None, invalid: InvalidRow | None = None,
                modality: str | None = None) -> None:
        from .media import describe_source

        if row is not None:
            key = id_hash(row.id, modality)
            attempt = self._attempts.get(key) + 1
            source = describe_source(row.image) if modality == "image" else None
            rec = ErrorRecord.from_error(err, id=row.id, manifest=row.manifest, line=row.line, offset=row.offset,
                                         modality=modality, source=source, attempt=attempt, task=self.task)
            self.counters.mod(modality or "").failed[err.code] = self.counters.mod(modality or "").failed.get(err.code, 0) + 1
        else:
            assert invalid is not None
            rec = ErrorRecord.from_error(err, id=invalid.id, manifest=invalid.manifest, line=invalid.line,
                                         offset=invalid.offset, modality=None, task=self.task)
            self.counters.invalid += 1
        with self._errors_lock:
            assert self._errors is not None
            self._errors.write(rec)
        if self.cfg.fail_fast and self._stopped_by is None:
            self._stopped_by = "fail-fast"
            self.stop.set()

    # -- main -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Run the task: take its lock (unless a device worker under its parent's lock) and encode."""
        t_start = time.perf_counter()
        if not self.primary:
            return self._run_locked(t_start)
        self.out.prepare()  # exists and writable (OutputError) before taking the lock
        from .outdir import LockWaitInterrupted

        try:
            lock = self.out.lock(self.task, wait=self.cfg.wait_lock, stop=self.stop)
        except LockWaitInterrupted:
            return RunResult(out=str(self.out.root), task=self.task, state="interrupted", counters=self.counters,
                             facts={}, elapsed=time.perf_counter() - t_start)
        with lock:
            open_output(self.out, self.cfg, self.task)
            self.out.clean_tmp(self.task)
            return self._run_locked(t_start)

    def _init_facts(self) -> dict[str, Any]:
        """The output's facts: from its metadata when the options match, else from the loaded model."""
        dtype = resolved_dtype(self.cfg)
        fp = fingerprint(self.cfg, dtype)
        facts = self._check_output(fp)
        if facts is None:
            self._load_encoder()
            facts = self._facts_from_encoder(dtype)
            created = self.out.create_run_meta({"fingerprint": fp, "facts": facts, "config": self.cfg.to_dict(),
                                                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                                "versions": library_versions()})
            if not created:  # another task or device worker was first: its options must match ours
                facts = self._check_output(fp) or facts
        return facts

    def _run_locked(self, t_start: float) -> RunResult:
        cfg = self.cfg
        if self.stop.is_set():  # stopped before starting: do not load a model for nothing
            return RunResult(out=str(self.out.root), task=self.task, state="interrupted", counters=self.counters,
                             facts={}, elapsed=time.perf_counter() - t_start)
        facts = self.facts = self._init_facts()
        modalities = tuple(cfg.modalities or facts["modalities"])
        missing = [m for m in modalities if m not in facts["modalities"]]
        if missing:
            raise OutputError(f"model {cfg.model.model} cannot encode {', '.join(missing)} "
                              f"(it supports: {', '.join(facts['modalities'])})")
        if self.primary:
            write_task_meta(self.out, cfg, "running", self.counters, time.perf_counter() - t_start)
        self._errors = ErrorReportWriter(self.out.error_report_path(self.task, self.worker))
        try:
            self._loop(modalities)
        finally:
            self._errors.close()
        state = "done"
        if self.stop.is_set():
            state = "stopped" if self._stopped_by == "fail-fast" else "interrupted"
        result = RunResult(out=str(self.out.root), task=self.task, state=state, counters=self.counters,
                           facts=facts, elapsed=time.perf_counter() - t_start,
                           model_loaded=self.encoder is not None, events=self.events)
        result.threshold_exceeded = threshold(cfg, self.counters)
        if self.primary:
            write_task_meta(self.out, cfg, state, self.counters, result.elapsed, result)
        return result


    # -- the loop -------------------------------------------------------------------------
    def _rows(self) -> Iterator[ManifestRow | InvalidRow]:
        from .manifest import iter_rows

        it = iter_rows(list(self.cfg.manifests), self.cfg.manifest, self.task, self.cfg.task_count)
        index = 0
        while True:
            t0 = time.perf_counter()
            try:
                rec = next(it)
            except StopIteration:
                return
            finally:
                self.counters.seconds["read"] += time.perf_counter() - t0
            if self.worker_count > 1:
                index += 1
                # rows of one id go to one worker, so its `seen` set catches duplicate ids (409)
                owner = (id_hash(rec.id) if isinstance(rec, ManifestRow) else index) % self.worker_count
                if owner != self.worker:
                    continue
            yield rec

    def _loop(self, modalities: tuple[str, ...]) -> None:
        done, failed_before, invalid_before = self._load_history()
        seen = HashSet64()
        stage = _Stages(self, modalities)
        try:
            for rec in self._rows():
                if self.stop.is_set():
                    break
                self.counters.rows += 1
                if isinstance(rec, InvalidRow):
                    self._invalid(rec, invalid_before)
                    continue
                if not seen.add(id_hash(rec.id)):
                    dup = InvalidRow(rec.manifest, rec.line, rec.offset, id=rec.id, error=MMError(
                        f"id {rec.id!r} is already used by an earlier row of this run",
                        stage="validate", reason="manifest.duplicate_id"))
                    self._invalid(dup, invalid_before)
                    continue
                present = 0
                for modality in modalities:
                    value = rec.image if modality == "image" else rec.text
                    if value is None:
                        self.counters.mod(modality).skipped += 1
                        continue
                    present += 1
                    ms = self.counters.mod(modality)
                    ms.requested += 1
                    if id_hash(rec.id, modality) in done:
                        ms.encoded_before += 1
                    elif id_hash(rec.id, modality, rec.manifest) in failed_before:
                        ms.failed_before += 1
                    else:
                        stage.add(Item(rec, modality))
                if not present:
                    self.counters.rows_skipped += 1
                stage.pump()
            stage.finish(interrupted=self.stop.is_set())
        except BaseException:
            stage.abort()
            raise

    def _invalid(self, inv: InvalidRow, invalid_before: HashSet64) -> None:
        if id_hash(inv.manifest, str(inv.offset)) in invalid_before:
            self.counters.invalid_before += 1
        else:
            self._record(inv.error, invalid=inv)


class _Stages:
    """The decode -> batch -> encode -> write machinery of one run."""

    def __init__(self, run: EncodeRun, modalities: tuple[str, ...]) -> None:
        self.run = run
        self.cfg = run.cfg
        self.modalities = modalities
        self.batch_size = self.cfg.batch.batch_size
        self.texts: list[tuple[Item, str]] = []  # texts waiting for their window to fill
        # windows cut and being (or done) tokenized, oldest first, each with its tokenize job (a
        # future when tokenized ahead); the texts of a window not in a full batch carry over
        self.windows: collections.deque[tuple[list[tuple[Item, Any]], Any]] = collections.deque()
        self.carry: list[tuple[Item, Any]] = []
        self.ahead: Any = None  # the tokenize-ahead thread (a 1-thread executor) and its pretokenize
        self.ahead_fn: Any = None
        self.images: list[tuple[Item, Any]] = []
        self.image_chunk: list[Item] = []
        self.pool: Any = None
        self.runner: Any = None
        self.shard: Any = None
        self.writer: _ShardCommitter | None = None
        self.normalize = bool(run.facts.get("normalize"))
        self.keep = tuple(self.cfg.manifest.keep)

    # -- lazily built parts (a finished re-run never loads the model) ----------------------
    def _ensure_ready(self) -> None:
        if self.runner is not None:
            return
        from .batching import BatchRunner
        from .writers import make_writer

        run = self.run
        run._load_encoder()
        enc = run.encoder
        self.runner = BatchRunner(self._encode_fn, self.batch_size, grow_after=self.cfg.batch.grow_after,
                                  free_memory=_free_device_memory, check=getattr(enc, "check_outputs", None))
        writer = make_writer(self.cfg.writer.format, run.out, run.facts, run.facts["out_dtype"], self.keep)
        self.writer = _ShardCommitter(run, writer)
        self._new_shard()

    def _ensure_pool(self) -> None:
        if self.pool is None:
            from .decode import DecodePool

            self._ensure_ready()
            workers = self.cfg.batch.resolved_workers
            self.pool = DecodePool(self.run.encoder.image_preprocessor(), self.cfg.media, workers,
                                   max_in_flight=self.batch_size * self.cfg.batch.prefetch_batches,
                                   stop=self.run.stop)

    def _new_shard(self) -> None:
        from .writers import ShardData

        self.shard = ShardData(keep={k: [] for k in self.keep})

    def _encode_fn(self, modality: str, payloads: Any) -> Any:
        out = self.run.encoder.encode(modality, payloads)
        if self.normalize and self.run.encoder.output_kind == "pooled":
            import torch

            out.vectors = torch.nn.functional.normalize(out.vectors.float(), p=2, dim=-1)
        return out

    # -- feeding --------------------------------------------------------------------------
    def add(self, item: Item) -> None:
        """Accept one pending item."""
        if item.modality == "text":
            text = self.cfg.model.text_prefix + item.row.text  # type: ignore[operator]
            if not item.row.text.strip():  # type: ignore[union-attr]
                self.run._record(MMError("text is empty after stripping whitespace", stage="validate",
                                         reason="text.empty"), row=item.row, modality="text")
                return
            self._ensure_ready()
            self.texts.append((item, text))
        else:
            self._ensure_pool()
            self.image_chunk.append(item)
            if len(self.image_chunk) >= max(1, min(8, self.batch_size)):
                self._submit_images()

    def _submit_images(self) -> None:
        if self.image_chunk:
            chunk, self.image_chunk = self.image_chunk, []
            self.pool.submit(chunk, [(it.row.image, it.row.base_dir) for it in chunk])

    def pump(self) -> None:
        """Encode whatever is ready: full text buckets, finished decodes, full image batches."""
        if len(self.texts) >= max(TEXT_WINDOW, self.batch_size * 8):
            self._cut_window()
            while len(self.windows) > (1 if self.ahead is not None else 0):  # keep one tokenizing
                self._encode_window(final=False)
        if self.pool is not None:
            for chunk, results in self.pool.ready():
                self._collect(chunk, results)
            while (batch := self._take_image_batch(final=False)):
                self._encode_images(batch)

    def _collect(self, chunk: list[Item], results: list[Any]) -> None:
        if results is None:  # the pool died while the run is stopping: neither written nor errored
            return
        secs = self.run.counters.seconds
        for item, dec in zip(chunk, results):
            secs["decode"] += sum(dec.seconds)
            if dec.error is not None:
                self.run._record(dec.error, row=item.row, modality="image")
            else:
                self.images.append((item, dec.value))

    def finish(self, interrupted: bool) -> None:
        """Flush everything (or, when interrupted, commit what is encoded and drop the rest)."""
        try:
            if not interrupted:
                self._submit_images()
                if self.pool is not None:
                    for chunk, results in self.pool.drain():
                        self._collect(chunk, results)
                        while (batch := self._take_image_batch(final=False)):
                            self._encode_images(batch)
                while (batch := self._take_image_batch(final=True)):
                    self._encode_images(batch)
                if self.texts:
                    self._cut_window()
                while self.windows:
                    self._encode_window(final=len(self.windows) == 1)
                if self.carry:
                    self._encode_window(final=True)
            if self.writer is not None:
                self._flush_shard()
                self.writer.close()
            device_seconds = getattr(self.run.encoder, "device_seconds", None)
            if device_seconds is not None and (busy := device_seconds()) is not None:
                self.run.counters.seconds["forward_device"] = busy  # CUDA events: the forward's GPU time
            cpu_path = getattr(self.run.encoder, "cpu_path_summary", None)
            if cpu_path is not None and (summary := cpu_path()):
                log.info("CPU forward, whole run: %s", summary)
        finally:
            self._stop_ahead()
            if self.pool is not None:
                self.pool.close(kill=interrupted)

    def abort(self) -> None:
        """Stop workers and the writer thread after an unexpected error."""
        self._stop_ahead()
        if self.pool is not None:
            self.pool.close(kill=True)
        if self.writer is not None:
            self.writer.close(check=False)

    # -- encoding -------------------------------------------------------------------------
    def _cut_window(self) -> None:
        """Make the texts waiting a window and start tokenizing it: on the tokenize-ahead thread
        where that is on (`tokenize_ahead`), else here and now."""
        window, self.texts = self.texts, []
        if self.ahead is None and self.ahead_fn is None:
            enc = self.run.encoder
            make = getattr(enc, "pretokenizer", None)
            if make is not None and tokenize_ahead(getattr(enc, "device", "cpu")):
                from concurrent.futures import ThreadPoolExecutor

                self.ahead_fn = make()
                self.ahead = ThreadPoolExecutor(1, thread_name_prefix="mmenc-tokenize")
            else:
                self.ahead_fn = getattr(enc, "pretokenize", None) or False
        if self.ahead is not None:
            self.windows.append((window, self.ahead.submit(self._pretokenize, window, self.ahead_fn)))
        else:
            self.windows.append((window, self._pretokenize(window, self.ahead_fn)))

    @staticmethod
    def _pretokenize(window: list[tuple[Item, Any]], pretokenize: Any) -> float:
        """Tokenize a window's texts in place (without padding; the encoder then only pads each
        batch); return the seconds it took. Without a `pretokenize` (or when it fails) the
        window keeps its strings and is bucketed by characters."""
        t0 = time.perf_counter()
        if pretokenize:
            raw = [i for i, (_, t) in enumerate(window) if isinstance(t, str)]
            try:
                tokens = pretokenize([window[i][1] for i in raw]) if raw else []
            except Exception as exc:  # e.g. one odd text: keep the strings, batches bisect to it
                log.info("pretokenizing %d texts failed (%s: %s): bucketing by characters",
                         len(raw), type(exc).__name__, exc)
                tokens = []
            for i, tok in zip(raw, tokens):
                window[i] = (window[i][0], tok)
        return time.perf_counter() - t0

    def _encode_window(self, final: bool) -> None:
        """Encode the oldest window (with the texts carried over) in full batches sorted by
        length; what does not fill a batch carries over, unless `final`."""
        window, job = self.windows.popleft() if self.windows else ([], 0.0)
        self.run.counters.seconds["tokenize"] += job if isinstance(job, float) else job.result()
        # length bucketing: sort by tokens (pretokenized: each batch is then only padded), else
        # by characters (TEXT_WINDOW gives the padding each window size leaves); a batch holds
        # one kind of payload, strings or tokenized texts
        texts, self.carry = self.carry + window, []
        texts.sort(key=lambda t: (not isinstance(t[1], str), len(t[1])))
        bs = self.batch_size
        cut = len(texts) if final else (len(texts) // bs) * bs
        todo, self.carry = texts[:cut], texts[cut:]
        for start in range(0, len(todo), bs * 4):
            part = todo[start:start + bs * 4]
            self._encode("text", [p[0] for p in part], [p[1] for p in part])
            if self.run.stop.is_set():
                return

    def _stop_ahead(self) -> None:
        if self.ahead is not None:
            self.ahead.shutdown(wait=True, cancel_futures=True)
            self.ahead = None

    def _take_image_batch(self, final: bool) -> list[tuple[Item, Any]] | None:
        """Cut the next image batch off `self.images`, or None when no full batch is ready yet.

        A batch holds at most `--batch-size` images and, with `--max-batch-tokens`, at most that
        many tokens (each image's `meta["tokens"]`; an image over the budget goes alone). It is
        ready when full by count, when the next image would overflow the budget, or at the end.
        """
        images, cap = self.images, self.batch_size
        budget = self.cfg.batch.max_batch_tokens
        if budget is None:
            cut = min(cap, len(images))
            if cut == 0 or (cut < cap and not final):
                return None
        else:
            cut = total = 0
            for _item, payload in images[:cap]:
                tokens = int((getattr(payload, "meta", None) or {}).get("tokens") or 0)
                if cut and total + tokens > budget:
                    break
                total += tokens
                cut += 1
            if cut == 0 or (cut == len(images) and cut < cap and not final):
                return None
        batch, self.images = images[:cut], images[cut:]
        return batch

    def _encode_images(self, batch: list[tuple[Item, Any]]) -> None:
        self._encode("image", [b[0] for b in batch], [b[1] for b in batch])

    def _encode(self, modality: str, items: list[Item], payloads: list[Any]) -> None:
        t0 = time.perf_counter()
        outcomes = self.runner.run(modality, payloads)
        self.run.counters.seconds["encode"] += time.perf_counter() - t0
        ms = self.run.counters.mod(modality)
        for item, payload, oc in zip(items, payloads, outcomes):
            if oc.error is not None:
                self.run._record(oc.error, row=item.row, modality=modality)
                continue
            ms.encoded += 1
            ms.truncated += int(oc.truncated)
            self.shard.add(item.row.id, modality, oc.value, item.row.keep, item.row, getattr(payload, "meta", None))
            if len(self.shard) >= self.cfg.writer.shard_size:
                self._flush_shard()
        for ev in self.runner.stats.events:
            self.run.events.append(ev)
        self.runner.stats.events.clear()
        self.run.progress(self.run.counters)

    def _flush_shard(self) -> None:
        if self.shard is not None and len(self.shard):
            assert self.writer is not None
            self.writer.submit(self.shard)
            self._new_shard()


class _ShardCommitter:
    """Writes shards on a background thread (off the encode loop), in order, at most 2 queued.

    A shard that cannot be written turns each of its items into a `write.failed` error row.
    Anything else that goes wrong on the thread is kept and re-raised in the encode loop.
    """

    def __init__(self, run: EncodeRun, writer: Any) -> None:
        self.run = run
        self.writer = writer
        self.seq = run.out.next_seq(run.task, run.worker)
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=2)
        self.committed = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, name="mmenc-writer", daemon=True)
        self.thread.start()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the shard writer thread failed: {type(self.error).__name__}: {self.error}") from self.error

    def submit(self, shard: Any) -> None:
        from .outdir import shard_name

        self._check()
        name = shard_name(self.run.task, self.run.worker, self.seq, self.writer.ext)
        self.seq += 1
        while True:
            try:
                self.queue.put((shard, name), timeout=0.5)
                return
            except queue.Full:
                self._check()

    def _work(self) -> None:
        try:
            while True:
                job = self.queue.get()
                if job is None:
                    return
                shard, name = job
                t0 = time.perf_counter()
                try:
                    try:
                        self.writer.write(shard, name)
                    except Exception as exc:  # the shard's items become error rows; the run goes on
                        err = MMError(f"could not write shard {name}: {exc}", stage="write", reason="write.failed",
                                      error=type(exc).__name__)
                        for row, mod in zip(shard.refs, shard.modalities):
                            self.run.counters.mod(mod).encoded -= 1
                            self.run._record(err, row=row, modality=mod)
                        continue
                    self.committed += 1  # committed: from here on nothing may turn its items into errors
                    if self.run._errors is not None:
                        with self.run._errors_lock:
                            self.run._errors.sync()
                finally:
                    self.run.counters.seconds["write"] += time.perf_counter() - t0
        except BaseException as exc:  # never die silently: the encode loop re-raises it
            self.error = exc

    def close(self, check: bool = True) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        if check:
            self._check()


def _free_device_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # freeing memory is best effort
        pass


def _device_worker(cfg: RunConfig, worker: int, worker_count: int, results: Any, parent: int) -> None:
    """Entry point of one device's process: encode its share of the task's slice."""
    import signal

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def watch_parent() -> None:  # the parent was SIGKILLed: commit whole shards and exit, never outlive it
        while not stop.wait(0.5):
            if os.getppid() != parent:
                stop.set()

    threading.Thread(target=watch_parent, daemon=True).start()
    out = OutDir(cfg.writer.out)
    try:
        # one live process per (task, worker): a re-run's worker waits for a dying orphan, never writes beside it
        with TaskLock(out.meta / "locks" / f"task-{cfg.task_index:05d}-w{worker:02d}.lock") as lock:
            lock.acquire(wait=True, poll=0.5)
            res = EncodeRun(cfg, worker=worker, worker_count=worker_count, stop=stop, primary=False).run()
        results.put((worker, res, None))
    except BaseException as exc:  # reported to the parent, which fails the run with the same exit code
        results.put((worker, None, (type(exc).__name__, str(exc))))


def _run_devices(cfg: RunConfig, progress: ProgressFn | None, stop: threading.Event) -> RunResult:
    """One process per device (`--device cuda:0,cuda:1`), under the task's lock held here."""
    import multiprocessing as mp
    import signal

    t_start = time.perf_counter()
    out = OutDir(cfg.writer.out)
    out.prepare()
    devices = cfg.model.devices
    child_cfg = replace(cfg, overwrite=False)
    with out.lock(cfg.task_index, wait=cfg.wait_lock):
        open_output(out, cfg, cfg.task_index)
        out.clean_tmp(cfg.task_index)
        counters = Counters()
        write_task_meta(out, cfg, "running", counters, 0.0)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_device_worker, args=(child_cfg, w, len(devices), results, os.getpid()), daemon=False)
                 for w in range(len(devices))]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        errors: list[str] = []
        forwarded = False
        while len(got) < len(procs):
            if stop.is_set() and not forwarded:
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGTERM)
                forwarded = True
            try:
                w, res, err = results.get(timeout=0.5)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in got]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        for i in dead:
                            got[i] = None
                            if stop.is_set():  # killed by the stop signal before its handler was installed
                                continue
                            errors.append(("RuntimeError", f"device worker {i} ({devices[i]}) died with exit code {procs[i].exitcode}"))
                continue
            got[w] = res
            if err:
                errors.append((err[0], f"device worker {w} ({devices[w]}): {err[0]}: {err[1]}"))
        for p in procs:
            p.join()
        if errors:
            from .encoders import ModelLoadError
            from .manifest import ManifestError

            kinds = {"OutputError": OutputError, "ModelLoadError": ModelLoadError, "ConfigError": ConfigError,
                     "ManifestError": ManifestError}
            names = {name for name, _ in errors}
            cls = kinds.get(names.pop(), RuntimeError) if len(names) == 1 else RuntimeError
            raise cls("; ".join(msg for _, msg in errors))
        facts: dict[str, Any] = {}
        states = []
        events: list[str] = []
        for res in got.values():
            if res is None:  # stopped before it started: nothing written
                states.append("interrupted")
                continue
            counters.merge(res.counters)
            facts = facts or res.facts
            states.append(res.state)
            events += res.events
        state = "interrupted" if "interrupted" in states else ("stopped" if "stopped" in states else "done")
        result = RunResult(out=str(out.root), task=cfg.task_index, state=state, counters=counters, facts=facts,
                           elapsed=time.perf_counter() - t_start,
                           model_loaded=any(r is not None and r.model_loaded for r in got.values()), events=events)
        result.threshold_exceeded = threshold(cfg, counters)
        write_task_meta(out, cfg, state, counters, result.elapsed, result)
        if progress:
            progress(counters)
        return result


def run_encode(cfg: RunConfig, *, encoder_factory: Callable[..., Any] | None = None,
               progress: ProgressFn | None = None, stop: threading.Event | None = None) -> RunResult:
    """Run `mmenc encode` for one task (one process per device when several are given)."""
    stop = stop or threading.Event()
    if len(cfg.model.devices) > 1 and encoder_factory is None:
        return _run_devices(cfg, progress, stop)
    return EncodeRun(cfg, encoder_factory=encoder_factory, progress=progress, stop=stop).run()
