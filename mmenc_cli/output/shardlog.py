"""The committed-shard log: which shards each task and worker committed, so readers notice one
that went missing.

`_mmenc/tasks/shards-tTTTTT-wWW.jsonl` gets one line (`name`, `rows`, `bytes`, and `sum`: the first
16 hex digits of the SHA-256 of the others) after each shard's rename, on the writer thread; a
line whose `sum` does not hold is damaged, and read as no line (a line without one, an earlier
mmenc's, is read as it is). `mmenc inspect` and `mmenc status` compare it with the shards on
disk: a listed shard that is gone is a problem to name (re-run the task: its items are encoded
again). A task's run, at its start, reconciles its logs with the disk: it drops what is gone
(those items are not done, so the run encodes them again) and adds what a killed run committed
without listing. A task with no log at all (an output of an earlier mmenc) is not checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from .outdir import OutDir, metadata_fault, parse_shard_name

log = logging.getLogger("mmenc")


def _sum(entry: dict[str, Any]) -> str:
    """The checksum of a log entry: the SHA-256 of its fields but `sum`, first 16 hex digits."""
    fields = json.dumps({k: v for k, v in entry.items() if k != "sum"}, sort_keys=True)
    return hashlib.sha256(fields.encode("ascii")).hexdigest()[:16]


def _line(entry: dict[str, Any]) -> str:
    """An entry as a log line, with its `sum`."""
    return json.dumps({**{k: v for k, v in entry.items() if k != "sum"}, "sum": _sum(entry)}) + "\n"


def log_commit(out: OutDir, task: int, worker: int, shard: Path, rows: int, size: int) -> None:
    """Append one committed shard to its (task, worker) log, durably."""
    line = _line({"name": shard.name, "rows": rows, "bytes": size})
    path = out.shard_log_path(task, worker)
    try:
        out.fs.append(path, line.encode("ascii"))
    except OSError as exc:
        raise metadata_fault(path, exc) from exc


def _rows(out: OutDir, shard: Path) -> int | None:
    """A committed shard's row count from its footer (Parquet: the shard or its sidecar/index)."""
    import pyarrow.parquet as pq

    source = shard
    if shard.suffix != ".parquet":
        index = out.index_path(shard.name)
        source = index if index.exists() else out.sidecar_path(shard.name)
    try:
        with source.open("rb") as fh:
            return int(pq.ParquetFile(fh).metadata.num_rows)
    except Exception:  # counted when readable; a damaged shard is the readers' finding
        return None


def read_logs(out: OutDir, damaged: list[str] | None = None) -> dict[tuple[int, int], dict[str, dict[str, Any]]]:
    """(task, worker) -> {shard name: entry} of every log; unreadable lines named in `damaged`."""
    logs: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for (task, worker), path in out.shard_log_paths():
        entries = logs.setdefault((task, worker), {})
        for number, raw in enumerate(path.read_bytes().splitlines(), 1):
            try:
                entry = json.loads(raw.decode("ascii"))
                if "sum" in entry and entry["sum"] != _sum(entry):
                    raise ValueError("its sum does not hold")
                entries[str(entry["name"])] = entry
            except (ValueError, KeyError, TypeError):
                if damaged is not None and raw.strip():
                    damaged.append(f"{path}: line {number} is not a shard entry")
    return logs


def missing_shards(out: OutDir) -> list[str]:
    """Shards a log lists as committed that are not in OUT (in a store, where nothing is logged:
    shards whose key file, written after the shard, is there without it)."""
    present = {p.name for p in out.shards()}
    if out.in_store:
        stems = {name.split(".", 1)[0] for name in present}
        ext = _shard_ext(out)
        return sorted(f"{stem}.{ext}" for stem in (k.name.split(".", 1)[0] for k in out.key_paths())
                      if stem not in stems)
    return sorted(name for entries in read_logs(out).values() for name in entries if name not in present)


def _shard_ext(out: OutDir) -> str:
    """The file ending of the output's shards (its run.json's --format; Parquet when unknown)."""
    meta = out.read_run_meta()
    config = meta.get("config") if isinstance(meta, dict) else None
    writer = config.get("writer") if isinstance(config, dict) else None
    fmt = writer.get("format") if isinstance(writer, dict) else None
    return fmt if fmt in ("parquet", "safetensors") else "parquet"


def reconcile(out: OutDir, task: int) -> list[str]:
    """At a task's start (under its lock): rewrite its logs to list exactly the shards on disk;
    return the names that were listed and are gone (their items will be encoded again)."""
    present: dict[int, list[Path]] = {}
    for shard in out.shards():
        parsed = parse_shard_name(shard.name)
        if parsed and parsed.task == task:
            present.setdefault(parsed.worker, []).append(shard)
    logs = {worker: entries for (t, worker), entries in read_logs(out).items() if t == task}
    gone: list[str] = []
    for worker in sorted(set(logs) | set(present)):
        entries, on_disk = logs.get(worker, {}), present.get(worker, [])
        names = {p.name for p in on_disk}
        gone += [name for name in entries if name not in names]
        if entries.keys() != names:
            _rewrite(out, task, worker, [entries.get(p.name) or _entry(out, p) for p in on_disk])
    for name in gone:
        log.warning("shard %s was committed but is missing from %s: its items are encoded again", name, out.root)
    return gone


def _entry(out: OutDir, shard: Path) -> dict[str, Any]:
    return {"name": shard.name, "rows": _rows(out, shard), "bytes": shard.stat().st_size}


def _rewrite(out: OutDir, task: int, worker: int, entries: list[dict[str, Any]]) -> None:
    path = out.shard_log_path(task, worker)
    try:
        out.fs.publish(path, "".join(_line(e) for e in entries).encode("ascii"))
    except OSError as exc:
        raise metadata_fault(path, exc) from exc

