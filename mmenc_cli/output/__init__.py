"""The output folder: its layout and names, writing into it (the one atomic write, a task's
shards, error report and metadata), opening a task, and what is damaged in it. The one owner of
everything under OUT: no other module builds or parses a name under `_mmenc/`."""

from __future__ import annotations

from .outdir import (
    META,
    SHARD_EXTS,
    OutDir,
    ShardName,
    fsync_dir,
    metadata_fault,
    open_output,
    parse_shard_name,
    read_json,
    shard_name,
    write_bytes_atomic,
    write_json_atomic,
)
from .shard_ids import damaged_shard, iter_shard_keys

__all__ = ["META", "SHARD_EXTS", "OutDir", "ShardName", "damaged_shard", "fsync_dir", "iter_shard_keys",
           "metadata_fault", "open_output", "parse_shard_name", "read_json", "shard_name", "write_bytes_atomic",
           "write_json_atomic"]
