"""The encode summary at a glance, `--json`, `--verbose`, and an accounting that does not hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.cli.encode import finish
from mmenc_cli.cli.render import summary_lines
from mmenc_cli.run.counters import Counters, RunResult
from tests.conftest import make_image, write_jsonl

runner = CliRunner()


def result(counters: Counters, **kw) -> RunResult:
    return RunResult(out="/data/out", task=0, state=kw.pop("state", "done"), counters=counters, facts={},
                     elapsed=12.34, model_loaded=kw.pop("model_loaded", True), **kw)


def counters(**per_modality: dict) -> Counters:
    c = Counters()
    for modality, counts in per_modality.items():
        for name, n in counts.items():
            if name == "failed":
                for code, k in n.items():
                    for _ in range(k):
                        c.add_failure(modality, code)
            else:
                c.add(modality, name, n)
    return c


def test_a_clean_run_is_three_lines_with_no_zeros() -> None:
    c = counters(image={"requested": 14, "encoded": 14, "skipped": 6},
                 text={"requested": 13, "encoded": 13, "skipped": 7, "truncated": 1})
    c.add_row("rows", 20)
    assert summary_lines(result(c)) == ["mmenc: 20 rows -> /data/out in 12.3 s: 27 items encoded, "
                                        "6 rows have no image, 7 rows have no text",
                                        "  image  14 encoded", "  text   13 encoded (1 truncated)"]


def test_failures_get_a_line_per_code_and_where_to_look() -> None:
    c = counters(image={"requested": 12, "encoded": 6, "failed": {404: 3, 415: 1}, "encoded_before": 2},
                 text={"requested": 4, "encoded": 2, "failed_before": 1, "not_attempted": 1})
    c.add_row("rows", 16)
    c.add_row("invalid", 2)
    lines = summary_lines(result(c, state="interrupted", threshold_exceeded="5 errors > --max-errors 1"))
    assert lines[0] == ("mmenc: interrupted after 16 rows -> /data/out in 12.3 s: 8 items encoded, 4 items failed, "
                        "2 invalid rows")
    assert lines[1:] == [
        "  image  6 encoded, 4 failed, 2 encoded earlier",
        "  text   2 encoded, 1 failed earlier, not retried, 1 not attempted",
        "  404 not found: 3", "  415 unsupported: 1", "  invalid rows (lines, samples, shards): 2",
        "  see: mmenc errors summary /data/out",
        "  1 item not attempted: re-run the same command to finish it",
        "  error threshold exceeded: 5 errors > --max-errors 1"]
    assert c.balanced  # 16 + 2 == (8 + 2) + (4 + 1 + 2) + 1


def test_an_accounting_that_does_not_hold_is_an_internal_error(capsys: pytest.CaptureFixture) -> None:
    c = counters(text={"requested": 3, "encoded": 2})  # one item neither encoded, failed nor left
    assert not c.balanced
    assert any(line.startswith("  ACCOUNTING ERROR: requested 3") for line in summary_lines(result(c)))
    with pytest.raises(typer.Exit) as exit:
        finish(result(c), None, json_out=False, verbose=False)
    assert exit.value.exit_code == 1


def test_json_result_on_stdout_and_verbose_seconds(tmp_path: Path) -> None:
    make_image(tmp_path / "a.png")
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "image": "a.png", "text": "a photo"},
                                                  {"id": "b", "image": "missing.png"}])
    out = tmp_path / "out"
    res = runner.invoke(app, ["encode", str(manifest), "--out", str(out), "--json", "--verbose", "--progress", "none",
                              "--workers", "0"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)  # one JSON object, nothing else on stdout
    assert doc["exit_code"] == 0 and doc["out"] == str(out) and doc["state"] == "done"
    assert doc["counters"]["encoded"] == 2 and doc["counters"]["failed"] == 1 and doc["counters"]["balanced"]
    assert doc["forward"]["mode"] == "auto" and doc["counters"]["seconds"]["load"] > 0
    assert "items/s without the model load; seconds: model load" in res.stderr
    assert "404 not found: 1" in res.stderr and "loaded in" in res.stderr  # the DEBUG line of --verbose
