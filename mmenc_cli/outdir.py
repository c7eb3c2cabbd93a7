"""The one owner of the output folder's layout.

Rule: data files at the top, everything else under a name starting with `_` or `.`, so Parquet
readers pointed at OUT see only embeddings::

    OUT/
      part-t00000-w00-000000.parquet      committed shards (task, worker, sequence; zero-padded)
      _mmenc/
        run.json                           fingerprint + config of the output (written once)
        tasks/task-00000.json              per task: state, counts, timings, versions (last run)
        tasks/shards-t00000-w00.jsonl      the shards each task and worker committed
        errors/errors-t00000-w00.jsonl     error reports, one per task and worker, append-only
        sidecars/part-....parquet          ids + kept fields of safetensors shards
        index/part-....parquet             ids, grids, sizes + kept fields of token shards
        keys/part-....keys                 per shard: (id, modality) and source hashes (`keyindex.py`)
        locks/task-00000.lock              one lock per (OUT, task)
        slurm/, logs/                      sbatch scripts from `mmenc slurm`, array task logs
        tmp/                               shards being written (renamed into place when complete)

A shard becomes visible only by an atomic rename after fsync; a run killed at any instant leaves
a whole shard or none. Leftover temp files of a task are removed when that task starts again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import OutputError
from .locks import TaskLock

META = "_mmenc"
SHARD_EXTS = (".parquet", ".safetensors")
# widths are minimums: a task index past 99999 or a millionth shard only makes the name longer
_SHARD_RE = re.compile(r"^part-t(\d{5,})-w(\d{2,})-(\d{6,})\.(parquet|safetensors)$")
_LOG_RE = re.compile(r"^shards-t(\d{5,})-w(\d{2,})\.jsonl$")


@dataclass(frozen=True, slots=True)
class ShardName:
    """A parsed shard file name."""

    task: int
    worker: int
    seq: int
    ext: str

    @property
    def name(self) -> str:
        """The file name, e.g. `part-t00003-w00-000012.parquet`."""
        return shard_name(self.task, self.worker, self.seq, self.ext)


def shard_name(task: int, worker: int, seq: int, ext: str) -> str:
    """The one shard-name function: task, worker and sequence zero-padded."""
    return f"part-t{task:05d}-w{worker:02d}-{seq:06d}.{ext.lstrip('.')}"


def parse_shard_name(name: str) -> ShardName | None:
    """Parse a shard file name; None for anything else."""
    m = _SHARD_RE.match(name)
    if not m:
        return None
    return ShardName(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4))


def parse_log_name(name: str) -> tuple[int, int] | None:
    """(task, worker) of a shard log's file name; None for anything else."""
    m = _LOG_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename in it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write bytes to a temp name beside `path`, fsync, rename, fsync the folder: readers see the
    old file or the new one, never part of one; the temp file is removed on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temp name beside `path`, fsync, rename: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_json(path: Path) -> Any | None:
    """Read a JSON file; None when absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def metadata_fault(path: Path, exc: OSError) -> OutputError:
    """The run-level error of metadata the output could not take (disk full, read-only, ...)."""
    return OutputError(f"cannot write {path}: {exc.strerror or exc}; free the space or fix the permissions, "
                       "then run the same command")


#: side files are Parquet named `.pq`, so tools that glob OUT for `*.parquet` (embedding-reader)
#: see only the embedding shards; outputs written before read with their `.parquet` side files
SIDE_EXT, LEGACY_SIDE_EXT = ".pq", ".parquet"


def _side_file(folder: Path, shard: str) -> Path:
    stem = Path(shard).stem
    path = folder / (stem + SIDE_EXT)
    legacy = folder / (stem + LEGACY_SIDE_EXT)
    return legacy if not path.exists() and legacy.exists() else path


class OutDir:
    """Paths and operations on one output folder."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().absolute()
        self.meta = self.root / META

    # ---- layout -------------------------------------------------------------------------
    @property
    def run_meta_path(self) -> Path:
        return self.meta / "run.json"

    def task_meta_path(self, task: int) -> Path:
        return self.meta / "tasks" / f"task-{task:05d}.json"

    def error_report_path(self, task: int, worker: int) -> Path:
        return self.meta / "errors" / f"errors-t{task:05d}-w{worker:02d}.jsonl"

    def error_report_paths(self) -> list[Path]:
        return sorted((self.meta / "errors").glob("errors-t*-w*.jsonl"))

    def sidecar_path(self, shard: str) -> Path:
        """The Parquet sidecar of a safetensors shard (ids, rows, kept fields)."""
        return _side_file(self.meta / "sidecars", shard)

    @property
    def slurm_dir(self) -> Path:
        """Where `mmenc slurm` writes sbatch scripts."""
        return self.meta / "slurm"

    @property
    def logs_dir(self) -> Path:
        """Where Slurm array tasks log by default."""
        return self.meta / "logs"

    def keys_path(self, shard: str) -> Path:
        """The key file of a shard (`keyindex.py`): its (id, modality) hashes and sources."""
        return self.meta / "keys" / (Path(shard).stem + ".keys")

    def index_path(self, shard: str) -> Path:
        """The Parquet index of a token shard (ids, grids, sizes, kept fields)."""
        return _side_file(self.meta / "index", shard)

    def tmp_path(self, name: str) -> Path:
        return self.meta / "tmp" / f".{name}.tmp"

    def lock_path(self, task: int) -> Path:
        return self.meta / "locks" / f"task-{task:05d}.lock"

    def task_meta_paths(self) -> list[Path]:
        return sorted((self.meta / "tasks").glob("task-*.json"))

    def shard_log_path(self, task: int, worker: int) -> Path:
        """The log of the shards a (task, worker) committed (`shardlog.py`)."""
        return self.meta / "tasks" / f"shards-t{task:05d}-w{worker:02d}.jsonl"

    def shard_log_paths(self) -> list[Path]:
        return sorted((self.meta / "tasks").glob("shards-t*-w*.jsonl"))

    # ---- setup --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create OUT and its `_mmenc` folders; fail with OutputError when not writable."""
        try:
            for sub in ("tasks", "errors", "sidecars", "index", "keys", "locks", "tmp"):
                (self.meta / sub).mkdir(parents=True, exist_ok=True)
            probe = self.meta / "tmp" / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"output folder {self.root} is not writable: {exc.strerror or exc}") from exc

    def exists(self) -> bool:
        """True when OUT holds an mmenc output (metadata or shards)."""
        return self.run_meta_path.exists() or bool(self.shards())

    def wipe(self) -> None:
        """Remove everything mmenc wrote (shards and `_mmenc`), for --overwrite; other files stay."""
        for path in self.shards():
            path.unlink(missing_ok=True)
        if self.meta.is_dir():
            for entry in self.meta.iterdir():
                if entry.name == "locks":  # held by this run (and maybe others): never unlink a live lock
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def clean_tmp(self, task: int) -> int:
        """Remove this task's leftover temp shards (a killed run's); other tasks' are untouched."""
        removed = 0
        for prefix in ("", "sidecars-", "index-"):  # shards, and the side files written before them
            for path in (self.meta / "tmp").glob(f".{prefix}part-t{task:05d}-*"):
                path.unlink(missing_ok=True)
                removed += 1
        for folder in ("sidecars", "index", "keys"):  # safetensors sidecars, token-shard indexes, key files
            for side in (self.meta / folder).glob(f"part-t{task:05d}-*.*"):
                if not any((self.root / (side.stem + ext)).exists() for ext in SHARD_EXTS):
                    side.unlink(missing_ok=True)  # written for a shard whose rename never happened
                    removed += 1
            for tmp in (self.meta / folder).glob(f".part-t{task:05d}-*.tmp"):  # a write killed half-way
                tmp.unlink(missing_ok=True)
                removed += 1
        return removed

    # ---- shards -------------------------------------------------------------------------
    def shards(self, ext: str | None = None) -> list[Path]:
        """Committed shards at the top of OUT, in (task, worker, sequence) order."""
        if not self.root.is_dir():
            return []
        out = []
        for entry in os.scandir(self.root):
            parsed = parse_shard_name(entry.name)
            if parsed and (ext is None or parsed.ext == ext.lstrip(".")):
                out.append(((parsed.task, parsed.worker, parsed.seq, parsed.ext), Path(entry.path)))
        return [path for _, path in sorted(out)]

    def next_seq(self, task: int, worker: int) -> int:
        """The next free shard sequence number for (task, worker)."""
        seqs = [p.seq for p in (parse_shard_name(s.name) for s in self.shards())
                if p and p.task == task and p.worker == worker]
        return max(seqs) + 1 if seqs else 0

    def check_new(self, name: str) -> None:
        """Refuse a shard name already committed (two processes sharing a task and worker), before
        anything of the new shard (a sidecar, an index) is written."""
        if (self.root / name).exists():
            raise OutputError(f"shard {name} already exists: two processes share a task and worker")

    def commit(self, tmp: Path, name: str) -> Path:
        """Make a fully written, fsynced temp file visible under its final name (atomic rename)."""
        self.check_new(name)
        final = self.root / name
        os.replace(tmp, final)
        fsync_dir(self.root)
        return final

    # ---- metadata -----------------------------------------------------------------------
    def read_run_meta(self) -> dict[str, Any] | None:
        return read_json(self.run_meta_path)

    def create_run_meta(self, data: dict[str, Any]) -> bool:
        """Create run.json unless it exists (atomically: concurrent tasks race safely); True if created."""
        tmp = self.meta / f".run.json.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            write_json_atomic(tmp, data)
            try:
                os.link(tmp, self.run_meta_path)  # fails if another process created it first
                return True
            except FileExistsError:
                return False
            finally:
                tmp.unlink(missing_ok=True)
                fsync_dir(self.meta)
        except OSError as exc:
            raise metadata_fault(self.run_meta_path, exc) from exc

    def read_task_metas(self) -> list[dict[str, Any]]:
        return [m for m in (read_json(p) for p in self.task_meta_paths()) if isinstance(m, dict)]

    def write_task_meta(self, task: int, data: dict[str, Any]) -> None:
        try:
            write_json_atomic(self.task_meta_path(task), data)
        except OSError as exc:
            raise metadata_fault(self.task_meta_path(task), exc) from exc

    # ---- locking ------------------------------------------------------------------------
    def lock(self, task: int, wait: bool = False, poll: float = 1.0, stop: Any = None) -> "TaskLock":
        """Take the lock of (OUT, task); LockBusy when held by a live process and not waiting."""
        lock = TaskLock(self.lock_path(task))
        lock.acquire(wait=wait, poll=poll, stop=stop)
        return lock


def iter_shard_keys(out: OutDir, damaged: list[str] | None = None) -> Iterator[tuple[Path, list[str], list[str]]]:
    """Yield (shard, ids, modalities) of every committed shard, reading only those columns. A
    shard that cannot be read (truncated, foreign) raises `OutputError` naming it, or with
    `damaged` given is named there and skipped."""
    for shard in out.shards():
        found = shard_keys(out, shard, damaged)
        if found is not None:
            yield shard, *found


def shard_keys(out: OutDir, shard: Path, damaged: list[str] | None = None) -> tuple[list[str], list[str]] | None:
    """(ids, modalities) of one committed shard, from its own columns (or its sidecar or index);
    a shard that cannot be read raises `OutputError`, or with `damaged` is named there (None)."""
    import pyarrow.parquet as pq

    source = shard if shard.suffix == ".parquet" else out.sidecar_path(shard.name)
    index = out.index_path(shard.name)  # token shards (writers/tokens.py)
    if shard.suffix != ".parquet" and index.exists():
        source = index
    try:
        table = pq.read_table(source, columns=["id", "modality"])
    except Exception as exc:  # pyarrow raises several types for a damaged or foreign file
        problem = damaged_shard(shard, exc)
        if damaged is None:
            raise OutputError(problem) from None
        damaged.append(problem)
        return None
    return table.column("id").to_pylist(), table.column("modality").to_pylist()


def damaged_shard(shard: Path, exc: BaseException) -> str:
    """What to say about a shard that cannot be read, and what to do."""
    text = " ".join(str(exc).split())[:200] or type(exc).__name__
    return (f"shard {shard} cannot be read ({text}): it is damaged or not mmenc's; delete it and re-run its "
            "task to encode its items again, or start over with --overwrite")
