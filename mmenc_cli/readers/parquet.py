"""Parquet manifests: streamed by row group, only the columns a row needs."""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import ManifestError
from . import files
from .formats import Source
from .lines import Raw
from .validate import Keys, check_columns

PARQUET_BATCH = 256  # rows converted to Python at once: inline images make rows large


def parquet_file(path: str) -> Any:
    """Open a Parquet manifest for streaming (buffered column reads, no whole-row-group buffer)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        source = files.open_binary(path) if files.is_url(path) else path
        return pq.ParquetFile(source, buffer_size=1 << 20, pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise ManifestError(f"cannot read Parquet manifest {path}: {exc}") from None


def parquet_records(src: Source, keys: Keys, a: int, b: int) -> Iterator[Raw]:
    """Parquet rows whose virtual position r*S//N lies in [a, b), reading only their row groups."""
    import pyarrow as pa

    with parquet_file(src.path) as pf:
        meta, names = pf.metadata, pf.schema_arrow.names
        check_columns(names, src.path, keys)
        lo, hi = -(-a * meta.num_rows // src.size), -(-b * meta.num_rows // src.size)
        groups, first, row = [], 0, 0
        for g in range(meta.num_row_groups):
            count = meta.row_group(g).num_rows
            if row < hi and row + count > lo:
                if not groups:
                    first = row
                groups.append(g)
            row += count
        if not groups:
            return
        columns = [c for c in keys.columns if c in names]
        row = first
        try:
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=groups,
                                         columns=columns):
                i, j = max(lo - row, 0), min(hi - row, batch.num_rows)
                for k, record in enumerate(batch.slice(i, j - i).to_pylist() if j > i else ()):
                    yield None, row + i + k, record, None
                row += batch.num_rows
                if row >= hi:
                    break
        except pa.ArrowException as exc:
            raise ManifestError(f"cannot read Parquet manifest {src.path}: {exc}") from None


def parquet_record(path: str, offset: int) -> dict[str, Any]:
    """Row `offset` of a Parquet file with all its columns, streaming only its row group."""
    with parquet_file(path) as pf:
        meta = pf.metadata
        if offset >= meta.num_rows:
            raise ManifestError(f"row {offset} is past the end of {path} ({meta.num_rows} rows)")
        row = 0
        for g in range(meta.num_row_groups):
            if offset < row + meta.row_group(g).num_rows:
                break
            row += meta.row_group(g).num_rows
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=[g]):
            if offset < row + batch.num_rows:
                return batch.slice(offset - row, 1).to_pylist()[0]
            row += batch.num_rows
    raise ManifestError(f"row {offset} not found in {path}")  # metadata and data disagree
