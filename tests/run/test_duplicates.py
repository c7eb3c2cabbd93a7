"""Ids are unique within an output, across tasks and runs: a second row of an id is a 409 row naming
where the id was first encoded; rows that only moved, and retries, are not duplicates; ids two
concurrent tasks both encoded are listed by `status` and `inspect`. Resume reads the shards' key
files, never the shards."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.output import OutDir
from mmenc_cli.run.pipeline import run_encode
from mmenc_cli.errors import OutputError
from mmenc_cli.output.history import load_history
from tests.fakes import FakeEncoder, factory
from tests.runs import embeddings, error_rows, make_cfg

runner = CliRunner()


def manifest(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in rows))
    return path


def run(manifests: list[Path], out: Path, task: int = 0, count: int = 1):  # type: ignore[no-untyped-def]
    cfg = replace(make_cfg(manifests, out), task_index=task, task_count=count)
    return run_encode(cfg, encoder_factory=factory(FakeEncoder()))


def test_a_duplicate_met_by_a_later_task_is_a_409_naming_where_it_was_first_encoded(tmp_path: Path) -> None:
    rows = [("x", "the first x")] + [(f"f{i}", f"filler {i}") for i in range(40)] + [("x", "another x")]
    m = manifest(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"
    run([m], out, 0, 2)
    second = run([m], out, 1, 2)
    assert second.counters.invalid == 1 and second.counters.balanced
    [dup] = [r for r in error_rows(out) if r["reason"] == "manifest.duplicate_id"]
    assert dup["code"] == 409 and dup["id"] == "x" and dup["offset"] > 0 and dup["task"] == 1
    assert f"{m} at offset 0" in dup["message"]
    assert sum(1 for k in embeddings(out) if k[0] == "x") == 1
    for task in range(3):  # another task count would slice the rows another way: refused, nothing written
        with pytest.raises(OutputError, match="started with 2 tasks, and this run is task .* of 3"):
            run([m], out, task, 3)
    assert len(error_rows(out)) == 1


def test_an_id_from_another_input_is_a_duplicate_but_a_moved_row_is_not(tmp_path: Path) -> None:
    a = manifest(tmp_path / "a.jsonl", [("x", "from a"), ("y", "why")])
    out = tmp_path / "out"
    run([a], out)
    b = manifest(tmp_path / "b.jsonl", [("x", "from b"), ("z", "zed")])
    res = run([b], out)
    assert res.counters.invalid == 1 and res.counters.mod("text").encoded == 1
    [dup] = error_rows(out)
    assert dup["id"] == "x" and f"{a} at offset 0" in dup["message"] and dup["manifest"] == str(b)
    manifest(a, [("new", "inserted first"), ("x", "from a"), ("y", "why")])  # every row of a moved
    moved = run([a], out)
    assert moved.counters.invalid == 0 and moved.counters.mod("text").encoded == 1  # only "new"
    assert moved.counters.mod("text").encoded_before == 2


def test_ids_two_concurrent_tasks_both_encoded_are_listed_by_status_and_inspect(tmp_path: Path) -> None:
    rows = [("x", "one x")] + [(f"f{i}", f"filler {i}") for i in range(40)] + [("x", "other x")]
    m = manifest(tmp_path / "m.jsonl", rows)
    out, other = tmp_path / "out", tmp_path / "other"
    run([m], out, 0, 2)
    run([m], other, 1, 2)  # task 1 could not see task 0's shards: it encoded its x too
    for path in OutDir(other).shards():
        shutil.copy(path, out / path.name)
    for sub in ("keys", "tasks"):
        for path in (OutDir(other).meta / sub).iterdir():
            shutil.copy(path, OutDir(out).meta / sub / path.name)
    status = runner.invoke(app, ["status", str(out), "--json"])
    assert status.exit_code == 4, status.output
    dups = json.loads(status.stdout)["duplicates"]
    assert dups["ids"] == 1 and dups["count"] == 1 and dups["examples"][0]["id"] == "x"
    inspected = runner.invoke(app, ["inspect", str(out)])
    assert inspected.exit_code == 4 and "1 id encoded from more than one row" in inspected.output


def test_a_resume_reads_key_files_not_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = manifest(tmp_path / "m.jsonl", [(f"t{i}", f"text {i}") for i in range(12)])
    out = tmp_path / "out"
    run([m], out)
    od = OutDir(out)
    assert len(list((od.meta / "keys").glob("*.keys"))) == len(od.shards()) == 3
    assert len(list((od.meta / "packs").glob("*.pack"))) == 1
    for key_file in [*(od.meta / "keys").glob("*.keys"), *(od.meta / "packs").glob("*.pack")]:
        key_file.unlink()  # an output of an earlier mmenc: no key files, no packs
    opened: list[str] = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda source, **kw: opened.append(str(source)) or real(source, **kw))
    assert len(load_history(od, (0, 0)).done) == 12 and len(opened) == 3  # read the old way once, key files written
    opened.clear()
    again = run([m], out)
    assert again.counters.encoded_now == 0 and again.counters.mod("text").encoded_before == 12 and not opened
