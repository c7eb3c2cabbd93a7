"""A run enters the output package once per act: once to open its task, once per shard commit,
once per report flush, once to close; it never reaches past that door (`output/task.py`).

Counted with a profiler: every call whose callee lives in `mmenc_cli/output/` and whose caller lives
in `mmenc_cli/run/`, on every thread (the shard writer's too). The history the task hands the run
(`output/history.py`, `output/keys.py`) is a value the run reads, not an act on the output.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from mmenc_cli.output import OutDir
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg

PACKAGE = Path(__file__).resolve().parents[2] / "mmenc_cli"
SAMPLES = PACKAGE.parent / "samples"
VALUES = ("history.py", "keys.py")


def acts_of(run: Any) -> Counter[str]:
    """The calls from run/ into output/ while `run()` runs, by callee."""
    output, caller_pkg = str(PACKAGE / "output"), str(PACKAGE / "run")
    calls: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(output):
            return
        back = frame.f_back
        if back is not None and back.f_code.co_filename.startswith(caller_pkg) \
                and not frame.f_code.co_filename.endswith(VALUES):
            calls[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_qualname}"] += 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return calls


def report_rows(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in OutDir(out).error_report_paths())


def test_a_run_of_the_samples_enters_the_output_once_per_act(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.jsonl"
    shutil.copytree(SAMPLES / "images", tmp_path / "images")
    rows = SAMPLES.joinpath("manifest.jsonl").read_text().splitlines()
    rows.append(json.dumps({"id": "gone", "image": "images/missing.png"}))  # with the samples' three: four rows
    manifest.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    cfg = make_cfg([manifest], out, shard_size=8)
    calls = acts_of(lambda: run_encode(cfg, encoder_factory=factory(FakeEncoder())))
    shards, rows_written = len(OutDir(out).shards()), report_rows(out)
    assert shards >= 3 and rows_written == 4
    assert calls == Counter({"task.py:open_task": 1, "task.py:TaskOutput.commit": shards,
                             "task.py:TaskOutput.flush_report": rows_written + shards,  # each row, each commit's sync
                             "task.py:TaskOutput.close": 1})
    again = acts_of(lambda: run_encode(cfg, encoder_factory=factory(FakeEncoder())))  # a finished output
    assert again == Counter({"task.py:open_task": 1, "task.py:TaskOutput.close": 1})


def test_the_count_sees_a_call_past_the_door(tmp_path: Path) -> None:
    """The profiler does see a run module calling output/ directly (the check can fail)."""
    from mmenc_cli.run import counters

    def reach_past() -> None:
        code = compile("from mmenc_cli.output import OutDir\nOutDir(path).shards()", counters.__file__, "exec")
        exec(code, {"path": tmp_path})

    calls = acts_of(reach_past)
    assert any(key.startswith("outdir.py:OutDir.") for key in calls), calls
