"""Hostile input: ids and paths that are not valid Unicode, huge texts and lines, CSV fields that
outgrow every limit. Each is accounted for, never loaded whole, and every errors command works."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from mmenc_cli.config import ManifestConfig
from mmenc_cli.readers import iter_rows
from mmenc_cli.readers.lines import read_line
from mmenc_cli.records import InvalidRow, ManifestRow
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import make_image, write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import embeddings, error_rows, make_cfg

ROOT = Path(__file__).resolve().parents[2]


def mmenc(*args: object) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, its output in UTF-8 as a terminal or a pipe would take it."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "mmenc_cli", *map(str, args)], capture_output=True, env=env,
                          cwd=ROOT)


def test_lone_surrogates_are_refused_and_every_errors_command_works(tmp_path: Path) -> None:
    make_image(tmp_path / "ok.png")
    lines = ['{"id": "a\\ud800", "text": "an id that is not Unicode"}',
             '{"id": "p", "image": "x\\udc80.png"}',
             '{"id": "k", "text": "fine", "note": "\\udfff"}',
             json.dumps({"id": "gone", "image": "missing.png"}),
             json.dumps({"id": "ok", "image": "ok.png", "text": "a photo"})]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    res = run_encode(make_cfg([manifest], out), encoder_factory=factory(FakeEncoder()))
    rows = {r["id"]: r for r in error_rows(out)}
    assert rows["a\ud800"]["reason"] == rows["p"]["reason"] == "manifest.invalid_type"
    assert rows["gone"]["code"] == 404 and res.counters.balanced
    assert {k for k, _ in embeddings(out)} == {"k", "ok"}  # a field that is not kept does not matter
    listed = mmenc("errors", "list", out, "--json")
    assert listed.returncode == 0, listed.stderr
    back = [json.loads(line) for line in listed.stdout.decode("utf-8").splitlines()]
    assert {r["id"] for r in back} == {"a\ud800", "p", "gone"}  # the escapes read back to the same ids
    for args in (("errors", "list"), ("errors", "summary"), ("errors", "summary", "--json"), ("status",),
                 ("inspect",)):
        done = mmenc(*args, out)
        assert done.returncode == 0, (args, done.stderr)
        assert b"Traceback" not in done.stderr and b"internal error" not in done.stderr
    assert b"a\\ud800" in mmenc("errors", "list", out).stdout
    retry = mmenc("errors", "retry", out, "-o", tmp_path / "retry.jsonl")
    assert retry.returncode == 0, retry.stderr
    assert [json.loads(line)["id"] for line in (tmp_path / "retry.jsonl").read_text().splitlines()] == ["gone"]


def test_a_line_over_the_row_limit_is_read_past_in_pieces(tmp_path: Path) -> None:
    """A 20 MB line against a 1 MB limit: one 413 row, the rows around it exact, and the reader
    never holds more than a few times the limit (tracemalloc)."""
    path = tmp_path / "m.jsonl"
    with open(path, "wb") as fh:
        fh.write(b'{"id": "before", "text": "a"}\n')
        fh.write(b'{"id": "huge", "text": "' + b"x" * (20 << 20) + b'"}\n')
        fh.write(b'{"id": "after", "text": "b"}\n')
    tracemalloc.start()
    rows = list(iter_rows([str(path)], ManifestConfig(max_row_bytes=1 << 20)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 6 << 20, peak  # a few times the limit, far below the 20 MB line
    assert [r.id for r in rows] == ["before", None, "after"]
    huge = rows[1]
    assert isinstance(huge, InvalidRow) and huge.error.code == 413 and huge.error.reason == "manifest.row_too_large"
    assert (huge.line, huge.offset, rows[2].offset, rows[2].line) == (2, 30, 30 + 20 * (1 << 20) + 27, 3)
    with open(path, "rb") as fh:
        assert read_line(fh, 100) == (b'{"id": "before", "text": "a"}\n', 30)
        assert read_line(fh, 100) == (None, 20 * (1 << 20) + 27)


def test_a_huge_text_is_cut_before_tokenizing_and_counted_truncated(tmp_path: Path, tiny_st: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mmenc_cli.config import BatchConfig, ModelConfig, RunConfig, WriterConfig
    from mmenc_cli.encoders import hf, load_encoder

    seen: list[int] = []
    real = hf.HFEncoder.pretokenize

    def spy(self, texts, tokenizer=None):
        seen.extend(len(t) for t in texts)
        return real(self, texts, tokenizer)

    monkeypatch.setattr(hf.HFEncoder, "pretokenize", spy)
    big = "word " * 2_000_000  # 10 M characters
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "big", "text": big}, {"id": "small", "text": "a cat"}])
    cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(tiny_st), device="cpu"),
                    writer=WriterConfig(out=str(tmp_path / "out")), batch=BatchConfig(workers=0))
    res = run_encode(cfg)
    enc = load_encoder(cfg.model, device="cpu")
    assert enc.max_text_chars == enc.max_length * hf.CHARS_PER_TOKEN and max(seen) == enc.max_text_chars
    assert res.counters.mod("text").encoded == 2 and res.counters.mod("text").truncated == 1
    got = embeddings(tmp_path / "out")[("big", "text")]
    want = enc.encode("text", [big[:enc.max_text_chars]]).vectors[0].numpy()
    want = want / (want ** 2).sum() ** 0.5 if res.facts["normalize"] else want
    assert abs(got - want).max() < 1e-5


def csv_file(path: Path, records: list[list[str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([["id", "text"], *records])
    return path


def test_a_csv_field_past_the_row_limit_spanning_lines_is_one_error_and_nothing_else(tmp_path: Path) -> None:
    """The field runs over 400 lines; the reader skips exactly to the end of its record: no rows
    made of the field's own lines, the next rows exact."""
    field = "\n".join(f'line {i} of a long "quoted" field, with commas' for i in range(400))
    path = csv_file(tmp_path / "m.csv", [["a", "first"], ["big", field], ["b", "second"], ["c", "third"]])
    rows = list(iter_rows([str(path)], ManifestConfig(max_row_bytes=4096)))
    assert [type(r).__name__ for r in rows] == ["ManifestRow", "InvalidRow", "ManifestRow", "ManifestRow"]
    assert rows[1].error.reason == "manifest.row_too_large" and [r.id for r in rows[2:]] == ["b", "c"]
    assert rows[3].text == "third" and rows[2].line == 403  # line numbers still exact
    default = list(iter_rows([str(path)], ManifestConfig()))  # under the default limit: one row
    assert [r.id for r in default] == ["a", "big", "b", "c"] and default[1].text == field


def test_a_csv_field_over_the_csv_modules_own_limit_is_read_whole(tmp_path: Path) -> None:
    """csv's field limit (128 KiB) is not mmenc's: a 1 MB quoted field spanning lines is one row."""
    field = "\n".join("x" * 999 for _ in range(1024))
    path = csv_file(tmp_path / "m.csv", [["big", field], ["b", "next"]])
    rows = list(iter_rows([str(path)], ManifestConfig()))
    assert [r.id for r in rows] == ["big", "b"] and all(isinstance(r, ManifestRow) for r in rows)
    assert rows[0].text == field


def test_invalid_utf8_inside_a_multiline_field_fails_that_record_only(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    path.write_bytes(b'id,text\na,"first"\nbad,"one\ntwo\xff\nthree, four\nfive"\nb,"second"\n')
    rows = list(iter_rows([str(path)], ManifestConfig()))
    assert [type(r).__name__ for r in rows] == ["ManifestRow", "InvalidRow", "ManifestRow"]
    assert rows[1].error.reason == "manifest.invalid_row" and rows[2].id == "b" and rows[2].text == "second"
    assert rows[2].line == 7
