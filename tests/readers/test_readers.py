"""Tests for mmenc_cli.readers: formats, row validation, rereading rows, task slicing."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmenc_cli.config import ManifestConfig
from mmenc_cli.readers import lines as reader_lines, parquet as reader_parquet
from mmenc_cli.readers import ManifestError, detect_format, iter_rows, read_raw_row, read_row
from mmenc_cli.records import InvalidRow, ManifestRow


def MultilineConfig(**kw: Any) -> ManifestConfig:
    """A ManifestConfig with the csv_multiline switch on."""
    return ManifestConfig(csv_multiline=True, **kw)


CFG = ManifestConfig()


def rows_of(paths: list[Path] | Path, cfg: ManifestConfig = CFG, i: int = 0, k: int = 1) -> list[Any]:
    paths = paths if isinstance(paths, list) else [paths]
    return list(iter_rows([str(p) for p in paths], cfg, i, k))


def write_jsonl(path: Path, lines: list[Any], eol: str = "\n", bom: bool = False,
                trailing: bool = True) -> Path:
    text = eol.join(x if isinstance(x, str) else json.dumps(x) for x in lines) + (eol if trailing else "")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


def same(row: Any) -> tuple[Any, ...]:
    """A comparable form of a row (MMError has no __eq__)."""
    if isinstance(row, InvalidRow):
        err = row.error
        return (row.manifest, row.line, row.offset, row.id, err.code, err.stage, err.reason, err.message)
    return (row.manifest, row.line, row.offset, row.id, row.image, row.text, row.keep, row.base_dir)


def reason(row: Any) -> str:
    assert isinstance(row, InvalidRow), row
    return row.error.reason


# ---------------------------------------------------------------------------------------------
# Formats


def test_detect_format() -> None:
    assert detect_format("a/B.JSONL") == "jsonl"
    assert detect_format("x.ndjson") == "jsonl"
    assert detect_format("x.jsonl.gz") == "jsonl.gz"
    assert detect_format("x.csv") == "csv"
    assert detect_format("x.tsv") == "tsv"
    assert detect_format("x.parquet") == "parquet"
    with pytest.raises(ManifestError, match="extension"):
        detect_format("x.txt")


def test_unknown_extension_and_missing_file_fail_at_call(tmp_path: Path) -> None:
    (tmp_path / "m.txt").write_text("{}\n")
    with pytest.raises(ManifestError, match="extension"):
        iter_rows([str(tmp_path / "m.txt")], CFG)
    with pytest.raises(ManifestError, match="not found"):
        iter_rows([str(tmp_path / "nope.jsonl")], CFG)
    with pytest.raises(ManifestError, match="task index"):
        iter_rows([], CFG, 3, 3)


def test_jsonl_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [
        {"id": "a", "image": "img/a.jpg", "text": "hello", "src": "web"},
        "",
        "   ",
        {"id": 7, "text": ""},
        {"id": "c", "image": "http://x/c.png", "text": None},
    ])
    cfg = ManifestConfig(keep=("src",))
    rows = rows_of(path, cfg)
    assert [r.id for r in rows] == ["a", "7", "c"]
    assert all(isinstance(r, ManifestRow) for r in rows)
    a, b, c = rows
    assert (a.line, a.offset, a.image, a.text, a.keep) == (1, 0, "img/a.jpg", "hello", {"src": "web"})
    assert (b.line, b.image, b.text, b.keep) == (4, None, "", {"src": None})  # "" text is kept
    assert (c.line, c.text) == (5, None)
    assert a.manifest == str(path) and a.base_dir == str(tmp_path)
    raw = path.read_bytes()
    assert raw[b.offset:].startswith(b'{"id": 7')


def test_custom_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"key": 1, "img": "x.jpg", "caption": "c"}])
    (row,) = rows_of(path, ManifestConfig(id_key="key", image_key="img", text_key="caption"))
    assert (row.id, row.image, row.text) == ("1", "x.jpg", "c")


def test_relative_manifest_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "m.jsonl", [{"id": "a", "image": "a.jpg"}])
    monkeypatch.chdir(tmp_path)
    (row,) = list(iter_rows(["sub/m.jsonl"], CFG))
    assert row.manifest == str(tmp_path / "sub" / "m.jsonl")
    assert row.base_dir == str(tmp_path / "sub")


def test_jsonl_invalid_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [
        "not json",
        "[1, 2]",
        {"image": "a.jpg"},
        {"id": "", "text": "x"},
        {"id": 1.5, "text": "x"},
        {"id": True, "text": "x"},
        {"id": "t", "text": 3},
        {"id": "i", "image": 5},
        {"id": "e"},
        {"id": "w", "image": "  ", "text": None},
        {"id": "ok", "text": "fine"},
    ])
    rows = rows_of(path)
    got = [(r.line, reason(r) if isinstance(r, InvalidRow) else "ok", r.id) for r in rows]
    assert got == [
        (1, "manifest.invalid_json", None),
        (2, "manifest.invalid_json", None),
        (3, "manifest.missing_id", None),
        (4, "manifest.missing_id", None),
        (5, "manifest.invalid_type", None),
        (6, "manifest.invalid_type", None),
        (7, "manifest.invalid_type", "t"),
        (8, "manifest.invalid_type", "i"),
        (9, "manifest.empty_row", "e"),
        (10, "manifest.empty_row", "w"),
        (11, "ok", "ok"),
    ]
    assert [r.error.stage for r in rows[:3]] == ["read", "read", "validate"]
    assert all(r.error.code == 400 for r in rows[:-1])
    assert rows[1].error.message == "line is an array, not a JSON object"
    assert rows[2].error.message == 'row has no "id" field'
    assert '"id" must be a string or an integer, not a number' == rows[4].error.message
    assert '"text" must be a string, not an integer' == rows[6].error.message
    assert 'row has neither "image" nor "text" (nor audio or video)' == rows[8].error.message


def test_limit_counts_valid_and_invalid(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", ["bad", {"id": "a", "text": "x"}, {"id": "b", "text": "y"}])
    assert len(rows_of(path, ManifestConfig(limit=2))) == 2
    assert rows_of(path, ManifestConfig(limit=0)) == []


def test_jsonl_crlf_bom_no_trailing_newline(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "x"}, "", {"id": "b", "text": "y"}],
                       eol="\r\n", bom=True, trailing=False)
    rows = rows_of(path)
    assert [(r.id, r.line, r.text) for r in rows] == [("a", 1, "x"), ("b", 3, "y")]
    for row in rows:
        assert read_raw_row(row.manifest, row.offset)["id"] == row.id
        assert read_row(row.manifest, row.offset, CFG, line=row.line) == row


def test_jsonl_gz(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("".join(json.dumps({"id": n, "text": f"t{n}"}) + "\n" for n in range(20)))
    rows = rows_of(path)
    assert [r.id for r in rows] == [str(n) for n in range(20)]
    assert read_raw_row(str(path), rows[5].offset) == {"id": 5, "text": "t5"}
    path.write_bytes(path.read_bytes()[:-12])  # truncated: a run-level error, not a crash
    with pytest.raises(ManifestError, match="cannot read"):
        rows_of(path)


def test_csv_rows_and_invalid_rows(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    path.write_bytes(b'\xef\xbb\xbfid,image,text,src\r\n'
                     b'1,a.jpg,"hi, there",web\r\n'
                     b'\r\n'
                     b'2,,only text,\r\n'
                     b'3,b.jpg\r\n'
                     b',c.jpg,x,y\r\n'
                     b'5,,,\r\n'
                     b'6,\xff.jpg,x,y\r\n'
                     b'7,d.jpg,last,z')
    rows = rows_of(path, ManifestConfig(keep=("src",)))
    assert [(r.id, r.line) for r in rows] == [("1", 2), ("2", 4), ("3", 5), (None, 6), ("5", 7),
                                              ("6", 8), ("7", 9)]
    one, two, three, empty_id, empty, bad_utf8, last = rows
    assert (one.image, one.text, one.keep) == ("a.jpg", "hi, there", {"src": "web"})
    assert (two.image, two.text, two.keep) == (None, "only text", {"src": None})  # empty cell = null
    assert reason(three) == "manifest.invalid_row" and "2 fields, the header has 4" in three.error.message
    assert reason(empty_id) == "manifest.missing_id"
    assert (empty.image, empty.text) == (None, "")  # an empty text cell is an empty text (422 when encoded)
    assert reason(bad_utf8) == "manifest.invalid_row" and "UTF-8" in bad_utf8.error.message
    assert (last.text, last.keep) == ("last", {"src": "z"})
    assert read_raw_row(str(path), one.offset) == {"id": "1", "image": "a.jpg", "text": "hi, there",
                                                   "src": "web"}
    for row in (one, two, last):
        assert read_row(str(path), row.offset, ManifestConfig(keep=("src",)), line=row.line) == row
    with pytest.raises(ManifestError, match="not the start of a line"):
        read_raw_row(str(path), one.offset + 1)
    with pytest.raises(ManifestError, match="header"):
        read_raw_row(str(path), 0)
    with pytest.raises(ManifestError, match="fields"):
        read_raw_row(str(path), three.offset)
    assert same(read_row(str(path), three.offset, CFG, line=5)) == same(three)


def test_tsv(tmp_path: Path) -> None:
    path = tmp_path / "m.tsv"
    path.write_text("id\ttext\n1\ta, b\n")
    (row,) = rows_of(path)
    assert (row.id, row.text, row.image) == ("1", "a, b", None)


def test_csv_header_without_needed_columns_is_run_level(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("key,text\n1,x\n")
    (tmp_path / "b.csv").write_text("id,caption\n1,x\n")
    with pytest.raises(ManifestError, match='no "id" column'):
        rows_of(tmp_path / "a.csv")
    with pytest.raises(ManifestError, match="neither"):
        rows_of(tmp_path / "b.csv")
    (tmp_path / "empty.csv").write_text("")
    assert rows_of(tmp_path / "empty.csv") == []


def test_parquet_rows_binary_and_struct(tmp_path: Path) -> None:
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "id": pa.array([1, 2, 3, 4], pa.int64()),
        "image": pa.array([{"bytes": b"\x89PNG", "path": "a.png"}, {"bytes": None, "path": "b.png"},
                           {"bytes": None, "path": None}, None], struct),
        "text": ["x", None, "z", None],
        "junk": ["j"] * 4,
    })
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    rows = rows_of(path)
    assert [(r.id, r.offset, r.line) for r in rows] == [("1", 0, None), ("2", 1, None), ("3", 2, None),
                                                        ("4", 3, None)]
    assert rows[0].image == b"\x89PNG" and rows[1].image == "b.png"
    assert (rows[2].image, rows[2].text) == (None, "z")
    assert reason(rows[3]) == "manifest.empty_row" and rows[3].id == "4"
    assert read_raw_row(str(path), 1) == {"id": 2, "image": {"bytes": None, "path": "b.png"},
                                          "text": None, "junk": "j"}
    assert read_row(str(path), 0, CFG) == rows[0]
    with pytest.raises(ManifestError, match="past the end"):
        read_raw_row(str(path), 4)

    plain = tmp_path / "bin.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "image": pa.array([b"raw", b""], pa.binary()),
                             "text": [None, "t"], "n": [1.5, 2.5]}), plain)
    rows = rows_of(plain, ManifestConfig(keep=("n", "absent")))
    assert (rows[0].image, rows[0].keep) == (b"raw", {"n": 1.5, "absent": None})
    assert (rows[1].image, rows[1].text) == (None, "t")

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": [1.5, None], "text": ["x", "y"]}), bad)
    assert [reason(r) for r in rows_of(bad)] == ["manifest.invalid_type", "manifest.missing_id"]
    with pytest.raises(ManifestError, match='no "key" column'):
        rows_of(bad, ManifestConfig(id_key="key"))


def test_parquet_is_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.parquet"
    n = 2000
    pq.write_table(pa.table({"id": list(range(n)), "text": ["t"] * n, "junk": ["x" * 100] * n}),
                   path, row_group_size=250)

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the manifest must be streamed, not read whole")

    monkeypatch.setattr(pq, "read_table", forbidden)
    monkeypatch.setattr(pq.ParquetFile, "read", forbidden)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", forbidden)
    calls: list[dict[str, Any]] = []
    real = pq.ParquetFile.iter_batches

    def spy(self: pq.ParquetFile, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    rows = rows_of(path, CFG, 2, 4)
    assert rows and len(rows) < n
    assert calls[0]["columns"] == ["id", "text"]  # no "junk", no absent "image"
    assert 0 < len(calls[0]["row_groups"]) < 8  # only the row groups the slice overlaps


# ---------------------------------------------------------------------------------------------
# Slicing between tasks


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["w" * rng.randint(0, 120) for _ in range(n)]


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, list[Path]]:
    """Manifests for the slicing tests; ids are unique across all of them."""
    n = 150
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"id": f"j{i}", "text": t} if i % 17 else "not json"
                                               for i, t in enumerate(_texts(n, 1))], trailing=False)
    csv_path = tmp_path / "b.csv"
    csv_path.write_text("id,image,text\r\n" + "".join(
        f"c{i},img{i}.jpg,{t}\r\n" + ("\r\n" if i % 11 == 0 else "") for i, t in enumerate(_texts(n, 2))),
        newline="")
    groups, single = tmp_path / "c.parquet", tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": [f"g{i}" for i in range(300)], "text": _texts(300, 3)}), groups,
                   row_group_size=37)
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(300)], "text": _texts(300, 4)}), single)
    multiline = tmp_path / "e.csv"
    multiline.write_text("id,text\n" + "".join(
        f'm{i},"{t}\nsecond, line ""q""\n{t}"\n' if i % 3 == 0 else f"m{i},{t}\n"
        for i, t in enumerate(_texts(n, 5))))
    return {"jsonl": [jsonl], "csv": [csv_path], "groups": [groups], "single": [single],
            "mixed": [jsonl, groups, csv_path], "multiline": [multiline]}


def _ids(rows: list[Any]) -> list[str]:
    return [r.id if r.id is not None else f"@{r.manifest}:{r.offset}" for r in rows]


@pytest.mark.parametrize("case", ["jsonl", "csv", "groups", "single", "mixed", "multiline"])
def test_slices_are_disjoint_complete_and_deterministic(
        case: str, corpus: dict[str, list[Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader_parquet, "PARQUET_BATCH", 16)  # slices cut inside batches and row groups
    cfg = MultilineConfig() if case == "multiline" else CFG
    paths = corpus[case]
    whole = rows_of(paths, cfg)
    by_id = {key: same(row) for key, row in zip(_ids(whole), whole)}
    assert len(by_id) == len(whole) > 100
    for k in range(1, 8):
        seen: list[str] = []
        for i in range(k):
            part = rows_of(paths, cfg, i, k)
            assert list(map(same, part)) == list(map(same, rows_of(paths, cfg, i, k)))
            for key, row in zip(_ids(part), part):
                assert same(row) == by_id[key]  # same line numbers and offsets as a single task
            seen += _ids(part)
        assert sorted(seen) == sorted(by_id), f"{case}: k={k}"


def test_multiline_csv_without_the_option_fails_loudly(corpus: dict[str, list[Path]]) -> None:
    paths = corpus["multiline"]
    whole = rows_of(paths)  # one task owns the whole file: exact
    assert whole[0].text.count("\n") == 2 and 'line "q"' in whole[0].text
    with pytest.raises(ManifestError, match="csv_multiline"):
        for i in range(3):
            rows_of(paths, CFG, i, 3)


def test_gz_rows_are_dealt_round_robin(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("".join(json.dumps({"id": n, "text": "t"}) + "\n" for n in range(30)))
    plain = write_jsonl(tmp_path / "p.jsonl", [{"id": f"p{n}", "text": "t"} for n in range(30)])
    for k in (1, 3, 7):
        parts = [_ids(rows_of([path, plain], CFG, i, k)) for i in range(k)]
        flat = [x for part in parts for x in part]
        assert sorted(flat) == sorted([str(n) for n in range(30)] + [f"p{n}" for n in range(30)])
        assert len(set(flat)) == len(flat)


def test_line_numbers_unknown_past_the_counting_limit(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [{"id": str(n), "text": "t" * 50} for n in range(40)])
    monkeypatch.setattr(reader_lines, "COUNT_LINES_UP_TO", 100)
    late = rows_of(path, CFG, 1, 2)
    assert late and all(r.line is None for r in late)
    assert all(read_raw_row(r.manifest, r.offset)["id"] == r.id for r in late)
    assert rows_of(path, CFG, 0, 2)[0].line == 1


def test_a_line_starting_exactly_at_a_task_start_belongs_to_that_task(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(f'{{"id":"{n}","text":"t"}}\n' for n in range(10)))
    lines = path.read_bytes().splitlines(keepends=True)
    assert len({len(x) for x in lines}) == 1  # equal lines: every task boundary is a line start
    parts = [[r.id for r in rows_of(path, CFG, i, 5) if isinstance(r, ManifestRow)] for i in range(5)]
    assert parts == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"], ["8", "9"]]


def test_parquet_row_positions_follow_the_documented_rule(tmp_path: Path) -> None:
    lead = write_jsonl(tmp_path / "lead.jsonl", [{"id": "x", "text": "t" * 500}])
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": list(range(97)), "text": _texts(97, 6)}), path, row_group_size=10)
    start, size, n, k = lead.stat().st_size, path.stat().st_size, 97, 5
    total = start + size
    for i in range(k):
        lo, hi = total * i // k, total * (i + 1) // k
        want = [str(r) for r in range(n) if lo <= start + r * size // n < hi]
        assert [r.id for r in rows_of([lead, path], CFG, i, k) if r.id != "x"] == want
