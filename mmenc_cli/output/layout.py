"""The output folder's names: every file mmenc writes under OUT, and the parsers that read them
back. Nothing here touches the disk.

Rule: data files at the top, everything else under a name starting with `_` or `.`, so Parquet
readers pointed at OUT see only embeddings::

    OUT/
      part-t00000-w00-000000.parquet      committed shards (task, worker, sequence; zero-padded)
      _mmenc/
        run.json                           fingerprint + config of the output (written once)
        tasks/task-00000.json              per task: state, counts, timings, versions (last run)
        tasks/shards-t00000-w00.jsonl      the shards each task and worker committed
        errors/errors-t00000-w00.jsonl     error reports, one per task and worker, append-only
        sidecars/part-....pq               ids + kept fields of safetensors shards
        index/part-....pq                  ids, grids, sizes + kept fields of token shards
        keys/part-....keys                 per shard: (id, modality) and source hashes (`keys.py`)
        packs/part-....pack                the key files of consecutive shards of one runner, in one file
        locks/task-00000.lock              one lock per (OUT, task); task-00000-w01.lock per device worker
        slurm/, logs/                      sbatch scripts from `mmenc slurm`, array task logs
        tmp/                               shards being written (renamed into place when complete)

Widths are minimums: a task index past 99999 or a millionth shard only makes a name longer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

META = "_mmenc"
SHARD_EXTS = (".parquet", ".safetensors")
#: the folders under `_mmenc/` a run makes
FOLDERS = ("tasks", "errors", "sidecars", "index", "keys", "packs", "locks", "tmp")
#: side files are Parquet named `.pq`, so tools that glob OUT for `*.parquet` (embedding-reader)
#: see only the embedding shards; outputs written before read with their `.parquet` side files
SIDE_EXT, LEGACY_SIDE_EXT = ".pq", ".parquet"

_SHARD_RE = re.compile(r"^part-t(\d{5,})-w(\d{2,})-(\d{6,})\.(parquet|safetensors)$")
_LOG_RE = re.compile(r"^shards-t(\d{5,})-w(\d{2,})\.jsonl$")
_REPORT_RE = re.compile(r"^errors-t(\d{5,})-w(\d{2,})(?:-\d{6,}-[0-9a-f]+-\d+)?\.jsonl$")
_TASK_META_RE = re.compile(r"^task-(\d{5,})\.json$")
_LOCK_RE = re.compile(r"^task-(\d{5,})\.lock$")


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

    @property
    def stem(self) -> str:
        return self.name.rsplit(".", 1)[0]


def shard_name(task: int, worker: int, seq: int, ext: str) -> str:
    """The one shard-name function: task, worker and sequence zero-padded."""
    return f"part-t{task:05d}-w{worker:02d}-{seq:06d}.{ext.lstrip('.')}"


def parse_shard_name(name: str) -> ShardName | None:
    """Parse a shard file name; None for anything else."""
    m = _SHARD_RE.match(name)
    return ShardName(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)) if m else None


def shard_prefix(task: int) -> str:
    """What every file of a task's shards starts with (its shards, side files, key files)."""
    return f"part-t{task:05d}-"


def log_name(task: int, worker: int) -> str:
    return f"shards-t{task:05d}-w{worker:02d}.jsonl"


def parse_log_name(name: str) -> tuple[int, int] | None:
    """(task, worker) of a shard log's file name; None for anything else."""
    m = _LOG_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def report_name(task: int, worker: int) -> str:
    return f"errors-t{task:05d}-w{worker:02d}.jsonl"


def report_part_name(task: int, worker: int, seq: int, runner: str, k: int) -> str:
    """A part of the error report in an object store: named after the shard it accompanies (the
    task's `seq`-th), the runner that wrote it and its place among that runner's parts."""
    return f"errors-t{task:05d}-w{worker:02d}-{seq:06d}-{runner}-{k}.jsonl"


def parse_report_name(name: str) -> tuple[int, int] | None:
    """(task, worker) of an error report's file name; None for anything else."""
    m = _REPORT_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def task_meta_name(task: int) -> str:
    return f"task-{task:05d}.json"


def parse_task_meta_name(name: str) -> int | None:
    """The task of a task-metadata file's name; None for anything else."""
    m = _TASK_META_RE.match(name)
    return int(m.group(1)) if m else None


def lock_name(task: int, worker: int | None = None) -> str:
    """The task's lock, or one device worker's (`worker`) under it."""
    return f"task-{task:05d}.lock" if worker is None else f"task-{task:05d}-w{worker:02d}.lock"


def parse_lock_name(name: str) -> int | None:
    """The task of a task lock's file name (a device worker's lock is not a task lock: None)."""
    m = _LOCK_RE.match(name)
    return int(m.group(1)) if m else None


def side_name(shard: str, ext: str = SIDE_EXT) -> str:
    """A side file's name (sidecar, token index) for a shard file name."""
    return shard.rsplit(".", 1)[0] + ext


def keys_name(shard: str) -> str:
    return shard.rsplit(".", 1)[0] + ".keys"


def pack_name(first_shard: str) -> str:
    """A key pack's name: its first shard's, as `.pack`."""
    return first_shard.rsplit(".", 1)[0] + ".pack"


def parse_pack_name(name: str) -> ShardName | None:
    """A key pack's first shard (its extension unknown: `parquet`); None for anything else."""
    return parse_shard_name(name[:-len(".pack")] + ".parquet") if name.endswith(".pack") else None


def script_name(stamp: str, n: int = 1) -> str:
    """An sbatch script `mmenc slurm` writes (`-2`, `-3`, ... when the stamp's name is taken)."""
    return f"encode-{stamp}.sbatch" if n == 1 else f"encode-{stamp}-{n}.sbatch"


def shown(*parts: str) -> str:
    """How a path under `_mmenc/` is named in help texts and messages (`OUT/_mmenc/...`)."""
    return "/".join(["OUT", META, *parts])


def tmp_name(name: str) -> str:
    """A file being written under `tmp/` (hidden, so a listing of OUT never shows it)."""
    return f".{name}.tmp"
