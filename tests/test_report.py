"""The error report: append-only rows, a torn last line skipped."""

from __future__ import annotations

from pathlib import Path

from mmenc_cli.errors import MMError
from mmenc_cli.output.report import ErrorReportWriter, iter_error_records
from mmenc_cli.records import ErrorRecord


def test_report_is_append_only_and_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "errors.jsonl"
    for i in range(2):
        with ErrorReportWriter(path) as w:
            w.write(ErrorRecord.from_error(MMError("m", reason="text.empty", stage="validate"), id=f"i{i}",
                                           manifest="m.jsonl", line=i + 1, offset=i * 10, modality="text"))
    with open(path, "a") as fh:
        fh.write('{"id": "torn", "code"')  # a writer killed mid-line
    rows = list(iter_error_records([path, tmp_path / "missing.jsonl"]))
    assert [r["id"] for r in rows] == ["i0", "i1"] and rows[0]["code"] == 422
