"""A committed shard's ids and modalities read from its own columns (or its sidecar or index): what
a shard without a usable key record is known by, and the duplicates' examples."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ..errors import OutputError
from .fs import parquet_source
from .outdir import OutDir


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
        with parquet_source(source) as read_from:
            table = pq.read_table(read_from, columns=["id", "modality"])
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
