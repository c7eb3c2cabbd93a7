"""An img2dataset shard whose samples are missing (its tar or folder deleted, or nothing left but
its stats) is one 404 `manifest.missing_shard` row, reported by exactly one task of an array: never
taken for a Parquet-layout shard (captions encoded, images "skipped") and never dropped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.config import ManifestConfig
from mmenc_cli.records import InvalidRow, ManifestRow, NotDownloaded
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.readers.test_inputs import png, sample, write_tar
from tests.runs import embeddings, error_rows, make_cfg

STATUSES = ["success", "failed_to_download", "success"]


def shard_meta(root: Path, n: int, images: bool = False) -> list[dict[str, Any]]:
    """Shard n's metadata Parquet and stats, as img2dataset writes them; its rows."""
    keys = [f"{n:05d}{i:04d}" for i in range(len(STATUSES))]
    cols: dict[str, Any] = {"key": keys, "caption": [f"caption {k}" for k in keys], "status": STATUSES,
                            "error_message": [None if s == "success" else "404" for s in STATUSES]}
    if images:
        cols["jpg"] = [png(i) if s == "success" else None for i, s in enumerate(STATUSES)]
    pq.write_table(pa.table(cols), root / f"{n:05d}.parquet")
    (root / f"{n:05d}_stats.json").write_text(json.dumps({"count": 3, "successes": 2}))
    return [r for r in pa.table(cols).to_pylist() if r["status"] == "success"]


def layout_folder(root: Path, layout: str, shards: int = 4) -> Path:
    """An img2dataset output in one layout ("tar", "files" or "parquet")."""
    root.mkdir()
    for n in range(shards):
        ok = shard_meta(root, n, images=layout == "parquet")
        if layout == "tar":
            write_tar(root / f"{n:05d}.tar", [m for r in ok for m in sample(r["key"], n)])
        elif layout == "files":
            (root / f"{n:05d}").mkdir()
            for r in ok:
                (root / f"{n:05d}" / f"{r['key']}.jpg").write_bytes(png(n))
                (root / f"{n:05d}" / f"{r['key']}.txt").write_text(r["caption"])
    return root


def rows(root: Path, task: tuple[int, int] = (0, 1)) -> list[Any]:
    from mmenc_cli.readers import iter_rows

    return list(iter_rows([str(root)], ManifestConfig(), *task))


def summary(got: list[Any]) -> tuple[list[str], list[tuple[str, str, int]], int]:
    """(sample ids, (manifest name, reason, code) of the error rows, rows not downloaded)."""
    return ([r.id for r in got if isinstance(r, ManifestRow)],
            [(Path(r.manifest).name, r.error.reason, r.error.code) for r in got if isinstance(r, InvalidRow)],
            sum(isinstance(r, NotDownloaded) for r in got))


def test_a_shard_whose_tar_is_gone_is_a_missing_shard_not_a_parquet_shard(tmp_path: Path) -> None:
    """Was: shard 1 read as a Parquet-layout shard (captions encoded, no images, no error) and
    shard 2, with only its stats left, not there at all."""
    root = layout_folder(tmp_path / "laion", "tar")
    (root / "00001.tar").unlink()
    (root / "00002.tar").unlink()
    (root / "00002.parquet").unlink()
    ids, errors, not_downloaded = summary(rows(root))
    assert ids == ["000000000", "000000002", "000030000", "000030002"]
    assert errors == [("00001.tar", "manifest.missing_shard", 404), ("00002.tar", "manifest.missing_shard", 404)]
    assert not_downloaded == 3  # shards 0, 3 and the missing shard 1, whose metadata is there
    message = next(r for r in rows(root) if isinstance(r, InvalidRow)).error.message
    assert message.startswith(f"{root / '00001.tar'} does not exist: the samples of this img2dataset shard")


def test_each_layout_names_where_the_missing_samples_should_be(tmp_path: Path) -> None:
    files = layout_folder(tmp_path / "files", "files")
    shutil.rmtree(files / "00002")
    assert summary(rows(files))[1] == [("00002", "manifest.missing_shard", 404)]
    inline = layout_folder(tmp_path / "inline", "parquet")
    (inline / "00003.parquet").unlink()  # the Parquet layout: the samples are the metadata Parquet
    ids, errors, not_downloaded = summary(rows(inline))
    assert errors == [("00003.parquet", "manifest.missing_shard", 404)] and not_downloaded == 3 and len(ids) == 6
    bare = layout_folder(tmp_path / "bare", "none", shards=2)  # metadata and stats only: no layout at all
    ids, errors, not_downloaded = summary(rows(bare))
    assert ids == [] and errors == [("00000", "manifest.missing_shard", 404), ("00001", "manifest.missing_shard", 404)]


def test_a_missing_shard_is_reported_by_exactly_one_task(tmp_path: Path) -> None:
    root = layout_folder(tmp_path / "laion", "tar", shards=6)
    for n in (0, 3, 5):  # the first, a middle and the last shard
        (root / f"{n:05d}.tar").unlink()
    (root / "00003.parquet").unlink()
    whole = rows(root)
    assert summary(whole)[1] == [(f"{n:05d}.tar", "manifest.missing_shard", 404) for n in (0, 3, 5)]
    for k in (1, 3, 8):
        shares = [rows(root, (i, k)) for i in range(k)]
        union = [r for share in shares for r in share]
        assert sorted(map(repr, union)) == sorted(map(repr, whole)), k


def test_a_run_over_a_shard_with_its_tar_gone_reports_it(tmp_path: Path) -> None:
    """The run ends 0 with the missing shard in the error report (`errors summary`), and its
    samples are never "encoded" as captions only."""
    root = layout_folder(tmp_path / "laion", "tar", shards=3)
    (root / "00001.tar").unlink()
    out = tmp_path / "out"
    res = run_encode(make_cfg([root], out), encoder_factory=factory(FakeEncoder()))
    c = res.counters
    assert c.balanced and c.invalid == 1 and c.not_downloaded == 3 and c.mod("text").encoded == 4
    assert {i for i, _ in embeddings(out)} == {"000000000", "000000002", "000020000", "000020002"}
    assert [(r["manifest"], r["reason"], r["code"]) for r in error_rows(out)] == [
        (str(root / "00001.tar"), "manifest.missing_shard", 404)]
    found = CliRunner().invoke(app, ["errors", "summary", str(out), "--json"], catch_exceptions=False)
    assert json.loads(found.stdout)["by_reason"] == {"manifest.missing_shard": 1}


def test_a_metadata_parquet_that_cannot_be_read_is_an_error_row_of_its_own(tmp_path: Path) -> None:
    """Was: ArrowInvalid out of the reader (exit 1). The tar's samples are still encoded."""
    root = layout_folder(tmp_path / "laion", "tar", shards=2)
    (root / "00001.parquet").write_bytes(b"junk" * 100)
    ids, errors, not_downloaded = summary(rows(root))
    assert ids == ["000000000", "000000002", "000010000", "000010002"] and not_downloaded == 1
    assert errors == [("00001.parquet", "manifest.bad_shard", 400)]
    inline = layout_folder(tmp_path / "inline", "parquet", shards=2)
    (inline / "00000.parquet").write_bytes(b"junk" * 100)
    ids, errors, not_downloaded = summary(rows(inline))
    assert ids == ["000010000", "000010002"] and errors == [("00000.parquet", "manifest.bad_shard", 400)]
