"""Damaged Arrow and Parquet inputs and saved datasets never end the run or crash it: a bad cell is
its row's error, a bad record batch or row group one error row for its rows, an unreadable file one
error row, a data file a saved dataset lists but lacks one 404 row; a random corruption corpus,
read in subprocesses, shows every way reading ends."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmenc_cli.config import ManifestConfig
from mmenc_cli.errors import ManifestError
from mmenc_cli.readers import iter_rows, read_raw_row
from mmenc_cli.records import InvalidRow, ManifestRow
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.readers import damaged_corpus
from tests.runs import embeddings, error_rows, make_cfg


def rows(inputs: list[Any], task: tuple[int, int] = (0, 1)) -> list[Any]:
    return list(iter_rows([str(p) for p in inputs], ManifestConfig(), *task))


def kinds(got: list[Any]) -> list[Any]:
    return [r.id if isinstance(r, ManifestRow) else (r.offset, r.error.reason, r.id) for r in got]


def not_utf8(values: list[bytes]) -> pa.Array:
    """A string column holding bytes that are not UTF-8 (as a damaged or foreign writer leaves)."""
    return pa.array(values, pa.binary()).view(pa.string())


def write_ipc(path: Path, batches: list[pa.RecordBatch], stream: bool) -> Path:
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        with new(sink, batches[0].schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
    return path


def test_a_string_cell_that_is_not_utf8_is_its_rows_error(tmp_path: Path) -> None:
    """Was: UnicodeDecodeError out of the reader (exit 1), the other inputs never read."""
    table = pa.table({"id": not_utf8([b"a", b"b", b"c\xff", b"d"]),
                      "text": not_utf8([b"one", b"t\xc3(wo", b"three", b"four"])})
    pq.write_table(table, tmp_path / "m.parquet")
    write_ipc(tmp_path / "m.arrow", table.to_batches(), stream=True)
    write_ipc(tmp_path / "f.arrow", table.to_batches(), stream=False)
    for name in ("m.parquet", "m.arrow", "f.arrow"):
        got = rows([tmp_path / name])
        assert kinds(got) == ["a", (1, "manifest.invalid_type", "b"), (2, "manifest.invalid_type", None), "d"]
        assert got[1].error.message.startswith('"text" is not valid UTF-8') and got[1].error.code == 400
        assert read_raw_row(str(tmp_path / name), 3) == {"id": "d", "text": "four"}
        with pytest.raises(ManifestError, match=r'row 1 of .* cannot be read: "text" is not valid UTF-8'):
            read_raw_row(str(tmp_path / name), 1)


def test_a_run_goes_on_past_a_bad_cell_to_the_next_input(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": ["a", "b"], "text": not_utf8([b"ok", b"\xff"])}), tmp_path / "m.parquet")
    (tmp_path / "n.jsonl").write_text('{"id": "c", "text": "next input"}\n')
    out = tmp_path / "out"
    res = run_encode(make_cfg([tmp_path / "m.parquet", tmp_path / "n.jsonl"], out),
                     encoder_factory=factory(FakeEncoder()))
    assert res.counters.balanced and set(embeddings(out)) == {("a", "text"), ("c", "text")}
    assert [(r["id"], r["reason"], r["offset"]) for r in error_rows(out)] == [("b", "manifest.invalid_type", 1)]


def _broken_batch(first: int, n: int = 5) -> pa.RecordBatch:
    """A batch whose string offsets go backwards: what converting it unchecked turned into a
    SystemError (or a read out of bounds)."""
    texts = pa.array([f"t{first + i}" for i in range(n)])
    offsets = pa.array([0, 2, 1, 3, 4, 6], pa.int32()).buffers()[1]
    broken = pa.Array.from_buffers(pa.string(), n, [None, offsets, texts.buffers()[2]])
    return pa.RecordBatch.from_arrays([pa.array([f"r{first + i}" for i in range(n)]), broken], ["id", "text"])


def _batch(first: int, n: int = 5) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([f"r{first + i}" for i in range(n)]),
                                       pa.array([f"t{first + i}" for i in range(n)])], ["id", "text"])


@pytest.mark.parametrize("stream", [True, False])
def test_a_damaged_record_batch_is_one_error_row_and_the_next_batch_is_read(tmp_path: Path, stream: bool) -> None:
    path = write_ipc(tmp_path / "m.arrow", [_batch(0), _broken_batch(5), _batch(10)], stream)
    got = rows([path])
    assert kinds(got) == [f"r{i}" for i in range(5)] + [(5, "manifest.bad_shard", None)] + [
        f"r{i}" for i in range(10, 15)]
    assert got[6].offset == 10 and got[5].error.stage == "read"
    assert got[5].error.message.startswith(f"{path} cannot be read rows 5 to 9 (ArrowInvalid: ")
    shares = [kinds(rows([path], (i, 2))) for i in range(2)]  # the bad batch is task 1's (b % k)
    assert shares[1] == [(5, "manifest.bad_shard", None)] and sorted(map(str, shares[0] + shares[1])) == sorted(
        map(str, kinds(got)))
    assert read_raw_row(str(path), 12)["id"] == "r12"
    with pytest.raises(ManifestError, match=f"row 6 of {path} cannot be read"):
        read_raw_row(str(path), 6)


def lost_range(row: InvalidRow) -> range:
    """The rows a bad_shard row of a Parquet file says are lost."""
    m = re.search(r"cannot be read rows? (\d+)(?: to (\d+))? \(", row.error.message)
    assert m is not None, row.error.message
    return range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)


def _damage_row_group(path: Path, group: int) -> None:
    """Overwrite the data pages of one row group's text column with junk."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(1)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start:start + chunk.total_compressed_size] = b"\x17" * chunk.total_compressed_size
    path.write_bytes(bytes(data))


def test_a_damaged_parquet_row_group_is_one_error_row_and_the_file_is_read_on(tmp_path: Path) -> None:
    """Was: ManifestError mid-file (exit 3), the rest of the file and the other inputs never read."""
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(20)], "text": [f"t{i}" for i in range(20)]}), path,
                   row_group_size=5)
    _damage_row_group(path, 2)
    got = rows([path])
    assert kinds(got) == [f"r{i}" for i in range(10)] + [(10, "manifest.bad_shard", None)] + [
        f"r{i}" for i in range(15, 20)]
    assert f"{path} cannot be read rows 10 to 14" in got[10].error.message
    for k in (2, 3, 5):  # each task reports the lost rows in its own range: together, each row once
        lost = [n for i in range(k) for r in rows([path], (i, k)) if isinstance(r, InvalidRow) for n in lost_range(r)]
        assert sorted(lost) == list(range(10, 15))
    with pytest.raises(ManifestError, match="cannot be read from row 10 on"):
        read_raw_row(str(path), 12)


def test_a_row_group_that_decodes_short_keeps_the_rows_after_it_in_place(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged page header can make a row group decode to fewer rows than the footer says
    (seen in the corpus): its missing rows are one error row, and the next group's rows keep the
    offsets the footer gives them (counted on, they would shift onto the wrong rows)."""
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(20)], "text": [f"t{i}" for i in range(20)]}), path,
                   row_group_size=5)
    real = pq.ParquetFile.iter_batches

    def short(self: pq.ParquetFile, *args: Any, row_groups: list[int] | None = None, **kw: Any) -> Any:
        for g in row_groups if row_groups is not None else range(self.num_row_groups):
            for batch in real(self, *args, row_groups=[g], **kw):
                yield batch.slice(0, 2) if g == 2 else batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", short)
    got = rows([path])
    assert kinds(got) == [f"r{i}" for i in range(12)] + [(12, "manifest.bad_shard", None)] + [
        f"r{i}" for i in range(15, 20)]
    assert [r.offset for r in got[13:]] == list(range(15, 20)) and list(lost_range(got[12])) == [12, 13, 14]
    assert "row group 2 holds 2 rows, its footer says 5" in got[12].error.message


def test_a_file_that_is_not_parquet_is_one_error_row(tmp_path: Path) -> None:
    """Was: ManifestError (exit 3) when the task reached it, after other inputs were encoded."""
    (tmp_path / "a.parquet").write_bytes(b"not parquet at all " * 50)
    (tmp_path / "b.parquet").write_bytes(b"")
    pq.write_table(pa.table({"id": ["x", "y"], "text": ["t", "u"]}), tmp_path / "c.parquet")
    pattern = tmp_path / "*.parquet"
    got = rows([pattern])
    assert kinds(got) == [(0, "manifest.bad_shard", None), (0, "manifest.bad_shard", None), "x", "y"]
    assert got[0].error.message.startswith(f"{tmp_path / 'a.parquet'} cannot be opened as Parquet")
    assert "is empty" in got[1].error.message
    for k in (2, 3, 7):  # one task reports each
        assert sorted(str(x) for i in range(k) for x in kinds(rows([pattern], (i, k)))) == sorted(map(str, kinds(got)))
    with pytest.raises(ManifestError, match="cannot read Parquet manifest"):
        read_raw_row(str(tmp_path / "a.parquet"), 0)


def _saved(tmp_path: Path) -> Path:
    """A saved dataset's folder as `datasets` writes it: two data files listed in state.json."""
    folder = tmp_path / "saved"
    folder.mkdir()
    for n in range(2):
        write_ipc(folder / f"data-0000{n}-of-00002.arrow", [_batch(n * 5)], stream=True)
    (folder / "state.json").write_text(json.dumps({"_data_files": [
        {"filename": f"data-0000{n}-of-00002.arrow"} for n in range(2)], "_split": None}))
    return folder


def test_a_saved_dataset_missing_a_data_file_reports_it_and_reads_the_rest(tmp_path: Path) -> None:
    """Was: FileNotFoundError (exit 1)."""
    folder = _saved(tmp_path)
    (folder / "data-00000-of-00002.arrow").unlink()
    got = rows([folder])
    assert kinds(got) == [(0, "manifest.missing_shard", None)] + [f"r{i}" for i in range(5, 10)]
    assert got[0].manifest == str(folder / "data-00000-of-00002.arrow") and got[0].error.code == 404
    assert f"listed in {folder / 'state.json'}" in got[0].error.message
    for k in (2, 3):
        assert sum(isinstance(r, InvalidRow) for i in range(k) for r in rows([folder], (i, k))) == 1
    parent = tmp_path / "dict"
    parent.mkdir()
    folder.rename(parent / "train")
    (parent / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    got = rows([parent])
    assert [r.manifest for r in got if isinstance(r, InvalidRow)] == [
        str(parent / "train" / "data-00000-of-00002.arrow"), str(parent / "test" / "state.json")]


@pytest.mark.parametrize("listing, content", [
    ("state.json", "{not json"), ("state.json", "[1, 2]"), ("state.json", '{"_data_files": [{"name": 1}]}'),
    ("state.json", b"\xff\xfe"), ("dataset_dict.json", '{"splits": "train"}'), ("dataset_dict.json", "{")])
def test_a_saved_dataset_listing_that_is_not_json_is_a_manifest_error(tmp_path: Path, listing: str,
                                                                     content: str | bytes) -> None:
    """Was: JSONDecodeError, AttributeError or TypeError (exit 1)."""
    folder = _saved(tmp_path)
    if listing == "dataset_dict.json":
        (folder / "state.json").unlink()
    target = folder / listing
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ManifestError, match=str(target)):
        rows([folder])


def test_a_corruption_corpus_never_crashes_the_reader_and_accounts_for_every_row(tmp_path: Path) -> None:
    """100 seeded corruptions (1 to 16 bytes) of an IPC file, an IPC stream, a Parquet file and a
    saved dataset, each read in a subprocess (whole and as 2 tasks, and every row reread as
    `errors retry` does): reading ends normally, or with a ManifestError (exit 3) naming the file
    (a damaged column name reads as a schema without the id column); never another exception or
    a signal. Every row of the file is a row, an invalid row, or in an error row's range, once."""
    jobs = damaged_corpus.variants(tmp_path, 100)
    results = damaged_corpus.read_all(jobs)
    assert len(results) == len(jobs)
    ended = [r for r in results if r["outcome"] not in ("ok", "manifest_error")]
    assert not ended, ended[:3]
    assert all(r["file"] in r["message"] for r in results if r["outcome"] == "manifest_error")
    wrong = [r for r in results if r["outcome"] == "ok" and (r["uncovered"] or r["twice"] or r["split_differs"])]
    assert not wrong, wrong[:3]
    assert sum(bool(r.get("errors")) for r in results) >= 30  # the corpus does damage what is read


def test_a_corruption_corpus_through_the_pipeline_exits_0_or_a_documented_code(tmp_path: Path) -> None:
    """Runs over 24 of the damaged inputs with the fake encoder, in a subprocess: each ends with
    exit 0 (or 3 or 4), its counters add up, and every row the reader gives is an embedding or an
    error row."""
    jobs = damaged_corpus.variants(tmp_path, 24, seed=11)
    for n, job in enumerate(jobs):
        job["out"] = str(tmp_path / f"out{n}")
    results = damaged_corpus.run_all(jobs)
    assert len(results) == len(jobs) and all(r["exit"] in (0, 3, 4) for r in results), results
    assert all(r["balanced"] and not r["lost"] for r in results), results
