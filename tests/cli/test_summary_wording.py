"""The summary a newcomer reads: a modality no row holds has no line, what was skipped is said as
the rows without a modality, and every count agrees with its noun ("1 row", "1 failed item")."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.cli.render import duplicates_line, plural, print_error_summary, summary_lines, word
from mmenc_cli.cli.status import _rerun_hint
from mmenc_cli.output.status import Duplicates
from tests.cli.test_render import counters, result
from tests.conftest import write_jsonl

runner = CliRunner()


def test_plural_and_word_agree_with_the_count() -> None:
    assert [plural(n, "row") for n in (0, 1, 2)] == ["0 rows", "1 row", "2 rows"]
    assert plural(1, "failed item") == "1 failed item" and plural(3, "invalid row") == "3 invalid rows"
    assert [word(n, "has", "have") for n in (1, 2)] == ["has", "have"]


def test_a_folder_of_photos_has_no_text_line() -> None:
    """29 photos, one broken, through a model with image and text towers."""
    c = counters(image={"requested": 29, "encoded": 28, "failed": {400: 1}}, text={"skipped": 29})
    c.add_row("rows", 29)
    assert summary_lines(result(c)) == [
        "mmenc: 29 rows -> /data/out in 12.3 s: 28 items encoded, 1 item failed, 29 rows have no text",
        "  image  28 encoded, 1 failed",
        "  400 bad input: 1",
        "  see: mmenc errors summary /data/out"]


def test_texts_only_have_no_image_line() -> None:
    c = counters(image={"skipped": 3}, text={"requested": 3, "encoded": 3})
    c.add_row("rows", 3)
    assert summary_lines(result(c)) == ["mmenc: 3 rows -> /data/out in 12.3 s: 3 items encoded, 3 rows have no image",
                                        "  text   3 encoded"]


def test_a_run_where_everything_failed() -> None:
    c = counters(image={"requested": 2, "failed": {404: 2}}, text={"skipped": 2})
    c.add_row("rows", 2)
    assert summary_lines(result(c)) == [
        "mmenc: 2 rows -> /data/out in 12.3 s: 2 items failed, 2 rows have no text",
        "  image  0 encoded, 2 failed",
        "  404 not found: 2",
        "  see: mmenc errors summary /data/out"]


def test_ones_are_singular() -> None:
    c = counters(image={"requested": 1, "failed": {503: 1}, "skipped": 1},
                 text={"requested": 2, "encoded": 1, "not_attempted": 1})
    c.add_row("rows", 2)
    c.add_row("invalid", 1)
    lines = summary_lines(result(c, state="interrupted"))
    assert lines[0] == ("mmenc: interrupted after 2 rows -> /data/out in 12.3 s: 1 item encoded, 1 item failed, "
                        "1 invalid row, 1 row has no image")
    assert "  1 item not attempted: re-run the same command to finish it" in lines
    c = counters(text={"requested": 1, "encoded": 1})
    c.add_row("rows", 1)
    assert summary_lines(result(c)) == ["mmenc: 1 row -> /data/out in 12.3 s: 1 item encoded", "  text   1 encoded"]


def test_nothing_asked_is_said_as_the_rows_without_it() -> None:
    c = counters(text={"skipped": 4})  # a folder of images encoded with --modality text
    c.add_row("rows", 4)
    assert summary_lines(result(c)) == ["mmenc: 4 rows -> /data/out in 12.3 s: 4 rows have no text"]


def test_the_other_tables_and_hints_agree_in_number(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    one = Duplicates(count=1, within_task=0, ids=1, examples=[])
    assert duplicates_line(one) == ("1 (id, modality) pair in several tasks, 0 repeated within a task, "
                                    "1 id encoded from more than one row")
    print_error_summary("/data/out", {"errors": 1, "groups": []})
    assert "1 failed item in /data/out" in capsys.readouterr().out
    report = SimpleNamespace(rerun=[3], out=str(tmp_path), task_count=4)
    assert _rerun_hint(report) == "re-run task 3: mmenc encode ... --task-count 4 --task-index 3"
    report.rerun = [1, 3]
    assert _rerun_hint(report) == "re-run tasks 1,3: mmenc encode ... --task-count 4 --task-index <each of 1,3>"


def test_one_missing_image_end_to_end(tmp_path: Path) -> None:
    """The CLI's own words for a run of one row that failed, and for its error report."""
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "image": "missing.png"}])
    out = tmp_path / "out"
    res = runner.invoke(app, ["encode", str(manifest), "--out", str(out), "--progress", "none", "--workers", "0"],
                        catch_exceptions=False)
    summary = [line for line in res.stderr.splitlines() if line.startswith("mmenc: ")]
    assert len(summary) == 1 and re.fullmatch(rf"mmenc: 1 row -> {re.escape(str(out))} in \d+\.\d s: 1 item failed, "
                                              r"1 row has no text", summary[0]), res.stderr
    assert "  image  0 encoded, 1 failed" in res.stderr and "  text " not in res.stderr
    res = runner.invoke(app, ["errors", "retry", str(out), "-o", str(tmp_path / "retry.jsonl")])
    assert res.exit_code == 0 and f"mmenc: wrote 1 row to {tmp_path / 'retry.jsonl'}" in res.stderr
    res = runner.invoke(app, ["errors", "summary", str(out)])
    assert res.exit_code == 0 and "1 failed item in" in res.stdout
