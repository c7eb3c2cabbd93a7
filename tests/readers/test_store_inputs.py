"""Text manifests in a bucket: JSONL and CSV read from an s3:// URL through s3fs (their lines are
bounded by --max-row-bytes with a sized readline, which fsspec's own files do not take)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmenc_cli.config import ManifestConfig
from mmenc_cli.readers import iter_rows
from mmenc_cli.records import InvalidRow, ManifestRow
from tests.s3server import bucket, s3_server  # noqa: F401

pytestmark = pytest.mark.slow


def test_jsonl_and_csv_in_a_bucket_are_read_with_their_limits(bucket: str, tmp_path: Path) -> None:
    import s3fs

    fs = s3fs.S3FileSystem()
    lines = [json.dumps({"id": f"j{i}", "text": f"text {i}"}) for i in range(50)]
    lines.insert(10, json.dumps({"id": "huge", "text": "x" * 5000}))
    fs.pipe(f"{bucket}/in/m.jsonl", ("\n".join(lines) + "\n").encode())
    fs.pipe(f"{bucket}/in/m.csv", ("id,text\n" + "".join(f"c{i},caption {i}\n" for i in range(30))).encode())
    cfg = ManifestConfig(max_row_bytes=1000)
    rows = list(iter_rows([f"s3://{bucket}/in/m.jsonl", f"s3://{bucket}/in/m.csv"], cfg))
    good = [r.id for r in rows if isinstance(r, ManifestRow)]
    bad = [r for r in rows if isinstance(r, InvalidRow)]
    assert good == [f"j{i}" for i in range(50)] + [f"c{i}" for i in range(30)]
    assert [r.error.reason for r in bad] == ["manifest.row_too_large"]
    split = [r.id for t in range(3) for r in iter_rows([f"s3://{bucket}/in/m.jsonl"], cfg, t, 3)
             if isinstance(r, ManifestRow)]
    assert sorted(split) == sorted(f"j{i}" for i in range(50))  # byte ranges of a bucket's file, each row once
