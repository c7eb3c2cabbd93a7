"""A failed start leaves nothing: inputs are checked before the model loads, and a run that fails
before its first row leaves no run.json, task record or report (a folder it created is removed),
so the same OUT takes a corrected command with another model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.cli.encode import DEMO_MODEL
from mmenc_cli.cli.render import summary_lines
from mmenc_cli.run.counters import Counters

runner = CliRunner()


def encode(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, ["encode", *args, "--workers", "0", "--progress", "none"])
    return res.exit_code, res.output


def texts(path: Path, n: int = 5) -> Path:
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(n)))
    return path


def test_inputs_are_checked_before_the_model_and_nothing_is_written(tmp_path: Path) -> None:
    good = texts(tmp_path / "m.jsonl")
    out = tmp_path / "out"
    for bad, said in ((str(tmp_path / "nope.jsonl"), "not found|does not exist"), (str(tmp_path / "none-*.jsonl"), "match"),
                      (str(tmp_path / "m.xyz"), "format|extension")):
        if bad.endswith(".xyz"):
            Path(bad).write_text("x")
        code, output = encode(str(good), bad, "--out", str(out), "--model", str(tmp_path / "no-such-model"))
        assert code in (2, 3) and re.search(said, output, re.I), output  # a usage error, or the inputs' (exit 3)
        assert "no-such-model" not in output  # the inputs were judged first: the model was never looked at
        assert "DEMO" not in output
        assert not out.exists()


def test_a_model_that_cannot_load_leaves_no_output(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl")
    out = tmp_path / "out"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    code, output = encode(str(manifest), "--out", str(out), "--model", str(broken))
    assert code == 3 and not out.exists(), output
    code, output = encode(str(manifest), "--out", str(out))  # the same OUT, another model
    assert code == 0, output


def test_a_run_refused_after_run_json_takes_a_corrected_command_with_another_model(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file stays")
    code, output = encode(str(manifest), "--out", str(out), "--modality", "audio")  # the demo model has no audio
    assert code == 3 and "cannot encode audio" in output
    assert sorted(p.name for p in out.rglob("*") if p.is_file() and p.parent.name != "locks") == ["notes.txt"]
    other = tmp_path / "other-model"
    shutil.copytree(DEMO_MODEL, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "_note": "another model"}))
    code, output = encode(str(manifest), "--out", str(out), "--model", str(other), "--modality", "text")
    assert code == 0, output
    assert (out / "notes.txt").exists()


def test_an_existing_outputs_record_survives_a_refused_run(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl")
    out = tmp_path / "out"
    assert encode(str(manifest), "--out", str(out), "--modality", "text")[0] == 0
    record = out / "_mmenc" / "tasks" / "task-00000.json"
    before = record.read_bytes()
    code, output = encode(str(manifest), "--out", str(out), "--modality", "audio")
    assert code == 3 and record.read_bytes() == before
    assert (out / "_mmenc" / "run.json").exists()  # an output's run.json is never removed by a refusal


def test_an_interrupt_while_starting_says_so() -> None:
    result = SimpleNamespace(state="interrupted", counters=Counters(), out="OUT", elapsed=4.2, model_loaded=False)
    [line] = summary_lines(result)  # type: ignore[arg-type]
    assert "interrupted while starting" in line and "0 rows" not in line and "run the same command" in line


def test_a_store_fault_of_a_shard_names_no_errno_and_no_disk() -> None:
    import errno

    from mmenc_cli.run.encode_stage import output_fault

    disk = str(output_fault(SimpleNamespace(error=OSError(errno.ENOSPC, "No space left on device", "/o/p"), name="p")))
    store = str(output_fault(SimpleNamespace(error=OSError("the store at http://s did not answer"), name="p")))
    assert "(ENOSPC)" in disk and "free the space" in disk
    assert "(None)" not in store and "free the space" not in store and "fix the store" in store
