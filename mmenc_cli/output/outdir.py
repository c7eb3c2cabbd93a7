"""One output folder: its paths (named by `layout.py`), what is committed in it, and its metadata.

A shard becomes visible only by an atomic rename after fsync; a run killed at any instant leaves
a whole shard or none. Leftover temp files of a task are removed when that task starts again.
Every write goes through the folder's filesystem (`fs.py`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import LockBusy, OutputError
from . import layout
from .fs import LOCAL, Content, fsync_dir, metadata_fault, publish_json, read_json
from .layout import META, SHARD_EXTS, ShardName, parse_shard_name, shard_name
from .locks import TaskLock
from .lease import alive as lease_alive
from .objectstore import StoreFS, is_store, local_root, open_root

__all__ = ["META", "SHARD_EXTS", "OutDir", "ShardName", "fsync_dir", "metadata_fault", "open_output",
           "parse_shard_name", "read_json", "shard_name", "write_bytes_atomic",
           "write_json_atomic"]


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Publish bytes at `path` on the local filesystem (temp file, fsync, rename, fsync of the folder)."""
    LOCAL.publish(path, data)


def write_json_atomic(path: Path, data: Any) -> None:
    """Publish a JSON document at `path` (as `write_bytes_atomic`)."""
    publish_json(path, data)


def open_output(out: "str | Path | OutDir", storage_options: Any = None) -> "OutDir":
    """The output at `out` (a folder, or an object-store URL opened with `storage_options`: a dict
    or (key, value) pairs); an `OutDir` already open is returned as it is. Every command opens its
    output here."""
    if isinstance(out, OutDir):
        return out
    return OutDir(out, dict(storage_options) if storage_options else None)


class OutDir:
    """Paths and operations on one output folder: a local folder (`LocalFS`) or a prefix in an
    object store (`objectstore.StoreFS`, when `root` is a URL). Paths are `pathlib.Path`s, or
    `upath.UPath`s in a store; `storage_options` go to the store's fsspec filesystem."""

    def __init__(self, root: str | Path, storage_options: dict[str, str] | None = None) -> None:
        root = str(root)
        if is_store(root):
            self.root: Any = open_root(root, storage_options)
            self.fs: Any = StoreFS(self.root.fs)
        else:
            self.root = Path(local_root(root)).expanduser().absolute()
            self.fs = LOCAL
        self.meta = self.root / META

    @property
    def in_store(self) -> bool:
        """Whether the output lives in an object store (no rename, no append, no lock)."""
        return bool(self.fs.url)

    def close(self) -> None:
        """Drop a store's local staging folder (a local output holds nothing)."""
        if self.in_store:
            self.fs.close()

    # ---- layout -------------------------------------------------------------------------
    @property
    def run_meta_path(self) -> Path:
        return self.meta / "run.json"

    def task_meta_path(self, task: int) -> Path:
        return self.meta / "tasks" / layout.task_meta_name(task)

    def task_meta_paths(self) -> list[tuple[int, Path]]:
        """(task, path) of every task's metadata file, in task order."""
        return sorted((t, p) for p in self._list("tasks") if (t := layout.parse_task_meta_name(p.name)) is not None)

    def error_report_path(self, task: int, worker: int) -> Path:
        return self.meta / "errors" / layout.report_name(task, worker)

    def error_report_paths(self) -> list[Path]:
        return sorted(p for p in self._list("errors") if layout.parse_report_name(p.name))

    def sidecar_path(self, shard: str) -> Path:
        """The Parquet sidecar of a safetensors shard (ids, rows, kept fields)."""
        return self._side_file("sidecars", shard)

    def index_path(self, shard: str) -> Path:
        """The Parquet index of a token shard (ids, grids, sizes, kept fields)."""
        return self._side_file("index", shard)

    def key_paths(self) -> list[Any]:
        """Every key file (one per committed shard)."""
        return sorted(p for p in self._list("keys") if p.name.endswith(".keys"))

    def keys_path(self, shard: str) -> Path:
        """The key file of a shard (`keys.py`): its (id, modality) hashes and sources."""
        return self.meta / "keys" / layout.keys_name(shard)

    def pack_path(self, first_shard: str) -> Path:
        """A key pack (`keyindex.py`) whose first shard is `first_shard`."""
        return self.meta / "packs" / layout.pack_name(first_shard)

    def pack_paths(self) -> list[Any]:
        """Every key pack (none in an output written before packs)."""
        return sorted(p for p in self._list("packs") if layout.parse_pack_name(p.name) is not None)

    def tmp_path(self, name: str) -> Path:
        return self.meta / "tmp" / layout.tmp_name(name)

    def lock_path(self, task: int, worker: int | None = None) -> Path:
        """The task's lock, or one device worker's lock under it."""
        return self.meta / "locks" / layout.lock_name(task, worker)

    def lock_paths(self) -> list[tuple[int, Path]]:
        """(task, path) of every task lock (device workers' locks are not listed)."""
        return sorted((t, p) for p in self._list("locks") if (t := layout.parse_lock_name(p.name)) is not None)

    def shard_log_path(self, task: int, worker: int) -> Path:
        """The log of the shards a (task, worker) committed (`shardlog.py`)."""
        return self.meta / "tasks" / layout.log_name(task, worker)

    def shard_log_paths(self) -> list[tuple[tuple[int, int], Path]]:
        """((task, worker), path) of every shard log."""
        return sorted((tw, p) for p in self._list("tasks") if (tw := layout.parse_log_name(p.name)) is not None)

    @property
    def local_home(self) -> Path:
        """Where the files Slurm itself reads or writes go (scripts, task logs): the output's
        `_mmenc` folder, or for an output in a store (which Slurm cannot read) the local folder
        `./mmenc-slurm/<bucket>_<prefix>`."""
        if not self.in_store:
            return self.meta
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(self.root).split("://", 1)[-1])
        return Path.cwd() / "mmenc-slurm" / name.strip("_")[:120]

    @property
    def slurm_dir(self) -> Path:
        """Where `mmenc slurm` writes sbatch scripts."""
        return self.local_home / "slurm"

    @property
    def logs_dir(self) -> Path:
        """Where Slurm array tasks log by default."""
        return self.local_home / "logs"

    def new_script_path(self, stamp: str) -> Path:
        """A free name for a new sbatch script in `slurm_dir` (`stamp`: when it is written)."""
        n = 1
        while (self.slurm_dir / layout.script_name(stamp, n)).exists():
            n += 1
        return self.slurm_dir / layout.script_name(stamp, n)

    def latest_script(self) -> Path | None:
        """The most recently written script in `slurm_dir`, if any."""
        scripts = [p for p in self.slurm_dir.glob("*.sbatch")] if self.slurm_dir.is_dir() else []
        return max(scripts, key=lambda p: p.stat().st_mtime) if scripts else None

    def _side_file(self, folder: str, shard: str) -> Any:
        path = self.meta / folder / layout.side_name(shard)
        if self.in_store:  # no output in a store was ever written with the legacy names
            return path
        legacy = self.meta / folder / layout.side_name(shard, layout.LEGACY_SIDE_EXT)
        return legacy if not path.exists() and legacy.exists() else path

    def _list(self, folder: str) -> list[Any]:
        base = self.meta / folder
        return [base / name for name, _, _ in self.fs.listdir(base)]

    def sizes(self) -> dict[str, int]:
        """Size of each file at the top of OUT, by name (one listing: the shards' sizes)."""
        return {name: size for name, size, is_dir in self.fs.listdir(self.root) if not is_dir}

    # ---- setup --------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create OUT and its `_mmenc` folders; fail with OutputError when not writable. In a
        store there are no folders: writing is tried when the task opens (`probe`)."""
        if self.in_store:
            return
        try:
            for sub in layout.FOLDERS:
                (self.meta / sub).mkdir(parents=True, exist_ok=True)
            probe = self.meta / "tmp" / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"output folder {self.root} is not writable: {exc.strerror or exc}") from exc

    def probe(self) -> bool:
        """Whether the output's store refuses to create an object whose name exists (a local
        folder does). OutputError when nothing can be written there."""
        if not self.in_store:
            return True
        try:
            return bool(self.fs.probe(self.meta))
        except OSError as exc:
            raise OutputError(f"output {self.root} is not writable: {exc.strerror or exc}") from exc

    def exists(self) -> bool:
        """True when OUT holds an mmenc output (metadata or shards)."""
        return self.run_meta_path.exists() or bool(self.shards())

    def wipe(self) -> None:
        """Remove everything mmenc wrote (shards and `_mmenc`), for --overwrite; other files stay."""
        for path in self.shards():
            self.fs.remove(path)
        if self.in_store:  # no locks live in a bucket
            self.fs.remove_tree(self.meta)
        elif self.meta.is_dir():
            for entry in self.meta.iterdir():
                if entry.name == "locks":  # held by this run (and maybe others): never unlink a live lock
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def clean_tmp(self, task: int) -> int:
        """Remove this task's leftover temp files and the side files of shards never committed (a
        killed run's); other tasks' are untouched."""
        prefix, removed = layout.shard_prefix(task), 0
        if self.in_store:
            self.fs.abort_uploads(self.root, prefix)
        for path in self._list("tmp"):  # shards being written (and side files, as earlier mmencs staged them)
            name = path.name.lstrip(".")
            if name.split("-", 1)[1:] and name.split("-", 1)[0] in ("sidecars", "index"):
                name = name.split("-", 1)[1]
            if name.startswith(prefix):
                self.fs.remove(path)
                removed += 1
        shards = self.sizes()
        for folder in ("sidecars", "index", "keys", "packs"):  # side files, key files, key packs
            for path in self._list(folder):
                stem = path.name.split(".", 1)[0]
                if path.name.startswith("." + prefix) and path.name.endswith(".tmp"):  # a write killed half-way
                    self.fs.remove(path)
                    removed += 1
                elif stem.startswith(prefix) and not any(stem + ext in shards for ext in SHARD_EXTS):
                    self.fs.remove(path)  # written for a shard that was never committed
                    removed += 1
        return removed

    # ---- shards -------------------------------------------------------------------------
    def shards(self, ext: str | None = None) -> list[Any]:
        """Committed shards at the top of OUT, in (task, worker, sequence) order."""
        return [path for path, _ in self.shard_entries(ext)]

    def shard_entries(self, ext: str | None = None) -> list[tuple[Any, int]]:
        """(path, size) of the committed shards, in (task, worker, sequence) order: one listing."""
        out = []
        for name, size, is_dir in self.fs.listdir(self.root):
            parsed = parse_shard_name(name)
            if parsed and not is_dir and (ext is None or parsed.ext == ext.lstrip(".")):
                out.append(((parsed.task, parsed.worker, parsed.seq, parsed.ext), self.root / name, size))
        return [(path, size) for _, path, size in sorted(out)]

    def next_seq(self, task: int, worker: int) -> int:
        """The next free shard sequence number for (task, worker)."""
        seqs = [p.seq for p in (parse_shard_name(s.name) for s in self.shards())
                if p and p.task == task and p.worker == worker]
        return max(seqs) + 1 if seqs else 0

    def size_of(self, path: Any) -> int:
        """A file's size in bytes (in a store, a call a stop request may cut short)."""
        return self.fs.size(path) if self.in_store else int(path.stat().st_size)

    def busy_tasks(self, own: int) -> list[int]:
        """The other tasks a live run holds (an flock locally; a fresh heartbeat in a store)."""
        if self.in_store:
            return [t for t, path in self.task_meta_paths() if t != own and lease_alive(read_json(path))]
        return [t for t, path in self.lock_paths() if t != own and TaskLock(path).is_held()]

    def task_running(self, task: int, record: Any) -> bool:
        """Whether a live run holds `task` now (`record`: its metadata; one file per device worker
        locally names the lock by its stem)."""
        if self.in_store:
            return lease_alive(record)
        return TaskLock(self.lock_path(task)).is_held()

    def check_new(self, name: str) -> None:
        """Refuse a shard name already committed (two processes sharing a task and worker), before
        anything of the new shard (a sidecar, an index) is written."""
        if (self.root / name).exists():
            raise OutputError(f"shard {name} already exists: two processes share a task and worker")

    def publish_shard(self, name: str, content: Content) -> Path:
        """Write a shard and make it visible under `name`: the commit. Locally a temp file,
        fsynced and renamed; in a store an object created only if the name is free (ShardTaken
        when another runner committed it first: the create is the check)."""
        if self.in_store:
            if not self.fs.create(self.root / name, content):
                raise ShardTaken(name)
            return self.root / name
        self.check_new(name)
        return self.fs.publish(self.root / name, content, tmp=self.tmp_path(name))

    def publish_shard_files(self, name: str, files: Any) -> Path:
        """A shard's files (`writers.ShardFiles`): its side files first, then the shard (the
        commit). In a store the side files too are created only if their names are free: of two
        runners of one task, the second stops at the first name the first has taken."""
        if not self.in_store:  # before any side file: a refused shard must not replace another's
            self.check_new(name)  # (in a store each side file's exclusive create checks its name)
        written = []
        try:
            for content, path in ((files.sidecar, self.sidecar_path), (files.index, self.index_path)):
                if content is None:
                    continue
                if not self.in_store:
                    self.fs.publish(path(name), content)
                elif not self.fs.create(path(name), content):
                    raise ShardTaken(name)
                written.append(path(name))
            return self.publish_shard(name, files.shard)
        except ShardTaken:
            for path in written:  # ours, for a name another runner took: nothing of it stays
                self.fs.remove(path)
            raise

    # ---- metadata -----------------------------------------------------------------------
    def read_run_meta(self) -> dict[str, Any] | None:
        return read_json(self.run_meta_path)

    def create_run_meta(self, data: dict[str, Any]) -> bool:
        """Create run.json unless it exists (concurrent tasks race safely); True if created."""
        try:
            return self.fs.create(self.run_meta_path, (json_text(data)).encode("utf-8"))
        except OSError as exc:
            raise metadata_fault(self.run_meta_path, exc) from exc

    def read_task_metas(self) -> list[dict[str, Any]]:
        return [m for m in (read_json(p) for _, p in self.task_meta_paths()) if isinstance(m, dict)]

    def write_task_meta(self, task: int, data: dict[str, Any]) -> None:
        try:
            publish_json(self.task_meta_path(task), data, self.fs)
        except OSError as exc:
            raise metadata_fault(self.task_meta_path(task), exc) from exc

    # ---- locking ------------------------------------------------------------------------
    def lock(self, task: int, wait: bool = False, poll: float = 1.0, stop: Any = None,
             worker: int | None = None) -> TaskLock:
        """Take the lock of (OUT, task), or of one device worker; LockBusy when held by a live
        process and not waiting."""
        lock = TaskLock(self.lock_path(task, worker))
        lock.acquire(wait=wait, poll=poll, stop=stop)
        return lock


class ShardTaken(LockBusy):
    """A shard name another runner of the same task committed first: this runner stops (exit 75),
    leaving nothing of that shard."""

    def __init__(self, name: str) -> None:
        super().__init__(f"shard {name} was committed by another runner of this task: that runner goes on, "
                         "this one stops")
        self.name = name


def json_text(data: Any) -> str:
    import json

    return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
