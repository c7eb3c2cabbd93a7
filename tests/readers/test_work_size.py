"""The size of a task's slice, known before a row is read (sizes only), and the position reached
as rows are read: what progress shows as a percentage."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmenc_cli.config import ManifestConfig
from mmenc_cli.readers import Reading, iter_rows, slice_size
from tests.s3server import bucket, s3_server  # noqa: F401


def jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": f"text number {i}"}) + "\n" for i in range(n)))
    return path


def parquet(path: Path, n: int, group: int = 10) -> Path:
    table = pa.table({"id": [f"r{i}" for i in range(n)], "text": [f"text number {i}" for i in range(n)]})
    pq.write_table(table, path, row_group_size=group)
    return path


def positions(paths: list[Path | str], task: int = 0, tasks: int = 1, **kw: object) -> tuple[Reading, list[int]]:
    """The slice's reading, and its `done` seen as each row arrives."""
    reading = Reading()
    seen = [reading.done for _ in iter_rows([str(p) for p in paths], ManifestConfig(**kw), task, tasks, reading)]
    return reading, seen


def test_a_jsonl_slice_is_its_bytes_and_its_rows_move_through_them(tmp_path: Path) -> None:
    m = jsonl(tmp_path / "m.jsonl", 50)
    size = m.stat().st_size
    assert slice_size([str(m)], ManifestConfig()) == Reading(total=size, unit="bytes")
    reading, seen = positions([m])
    assert reading.total == size and reading.done == size  # all read: 100%
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] < size and len(set(seen)) == 50


def test_tasks_split_the_total_and_each_reaches_its_own(tmp_path: Path) -> None:
    a, b = jsonl(tmp_path / "a.jsonl", 40), parquet(tmp_path / "b.parquet", 60)
    whole = a.stat().st_size + b.stat().st_size
    totals = []
    for task in range(3):
        reading, seen = positions([a, b], task, 3)
        assert reading.done == reading.total and seen == sorted(seen)
        totals.append(reading.total)
    assert sum(totals) == whole


def test_parquet_rows_are_placed_by_their_footer_count(tmp_path: Path) -> None:
    p = parquet(tmp_path / "p.parquet", 100)
    size = p.stat().st_size
    reading, seen = positions([p])
    assert reading.done == size
    assert seen == [r * size // 100 for r in range(100)]  # row r of N at r*S//N, as the slices place it


def test_csv_and_a_plain_tar_reach_their_size(tmp_path: Path) -> None:
    c = tmp_path / "m.csv"
    c.write_text("id,text\n" + "".join(f"r{i},text {i}\n" for i in range(30)))
    t = tmp_path / "s.tar"
    with tarfile.open(t, "w") as tar:
        for i in range(5):
            data = f"caption {i}".encode()
            info = tarfile.TarInfo(f"k{i}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    reading, seen = positions([c, t])
    assert reading.total == c.stat().st_size + t.stat().st_size == reading.done
    assert seen == sorted(seen) and len(seen) == 35 and seen[-1] > c.stat().st_size  # inside the tar


@pytest.mark.parametrize("stream", [False, True])
def test_every_task_passes_through_a_whole_arrow_file(tmp_path: Path, stream: bool) -> None:
    table = pa.table({"id": [f"r{i}" for i in range(60)], "text": [f"text number {i}" for i in range(60)]})
    path = tmp_path / "d.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        with (pa.ipc.new_stream if stream else pa.ipc.new_file)(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=10):
                writer.write_batch(batch)
    size = path.stat().st_size
    for task in range(2):  # batches b % 2 == task, read past the others
        reading, seen = positions([path], task, 2)
        assert reading.total == size == reading.done and seen == sorted(seen) and len(seen) == 30
        assert 0 < seen[0] < seen[-1] < size  # the byte its reader reached, batch by batch


def test_a_saved_dataset_is_sized_by_its_files(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    table = pa.table({"id": [f"r{i}" for i in range(20)], "text": [f"t{i}" for i in range(20)]})
    names = []
    for n in range(2):
        names.append(f"data-0000{n}-of-00002.arrow")
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=5)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    reading, seen = positions([folder])
    assert reading.total == sum((folder / n).stat().st_size for n in names) == reading.done and len(seen) == 40


def test_what_takes_no_room_has_no_total(tmp_path: Path) -> None:
    g = tmp_path / "m.jsonl.gz"
    with gzip.open(g, "wt") as fh:
        fh.write('{"id": "a", "text": "t"}\n')
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "x.png").write_bytes(b"not decoded by the reader")
    for given in ([g], [folder], [jsonl(tmp_path / "m.jsonl", 3), g]):
        reading, seen = positions(given)
        assert reading.total is None and seen


def test_a_limit_counts_rows(tmp_path: Path) -> None:
    m = jsonl(tmp_path / "m.jsonl", 50)
    reading, seen = positions([m], limit=7)
    assert (reading.total, reading.unit, reading.done) == (7, "rows", 7) and seen == list(range(7))


def test_an_input_in_a_bucket_is_sized_by_its_listing(tmp_path: Path, bucket: str) -> None:
    import s3fs

    local = parquet(tmp_path / "p.parquet", 40)
    s3fs.S3FileSystem().put(str(local), f"{bucket}/p.parquet")
    url = f"s3://{bucket}/p.parquet"
    assert slice_size([url], ManifestConfig()).total == local.stat().st_size
    reading, seen = positions([url])
    assert reading.done == reading.total == local.stat().st_size and len(seen) == 40 and seen == sorted(seen)


@pytest.mark.parametrize("tasks", [1, 4])
def test_the_slices_of_an_array_cover_the_space_once(tmp_path: Path, tasks: int) -> None:
    m = jsonl(tmp_path / "m.jsonl", 25)
    sizes = [slice_size([str(m)], ManifestConfig(), i, tasks).total for i in range(tasks)]
    assert sum(s or 0 for s in sizes) == m.stat().st_size
