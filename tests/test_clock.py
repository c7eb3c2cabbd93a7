"""One owner of the timestamp formats mmenc writes (`clock.py`): no other module calls strftime."""

from __future__ import annotations

import ast
from datetime import datetime
from pathlib import Path

from mmenc_cli.clock import file_stamp, timestamp

PACKAGE = Path(__file__).resolve().parent.parent / "mmenc_cli"

#: modules that may call strftime, and why
STRFTIME_ALLOWED = {
    "clock.py": "the one owner of the formats",
    "run/pipeline.py": "run.json's `created` stamp: the one left to move to clock.timestamp",
}


def test_one_owner_of_timestamp_formats() -> None:
    found = [module for path in sorted(PACKAGE.rglob("*.py"))
             if (module := path.relative_to(PACKAGE).as_posix()) not in STRFTIME_ALLOWED
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Attribute) and node.attr == "strftime"]
    assert found == [], "write timestamps with clock.timestamp (or clock.file_stamp)"


def test_the_timestamp_format() -> None:
    when = 1_700_000_000.0
    assert datetime.strptime(timestamp(when), "%Y-%m-%dT%H:%M:%S%z").timestamp() == when  # local, with its offset
    assert datetime.strptime(timestamp(), "%Y-%m-%dT%H:%M:%S%z")
    assert len(file_stamp(when)) == len("20231114-221320") and ":" not in file_stamp(when)
