"""A task's close when the output cannot say whether it holds what the run committed, a refused
start after --overwrite in a bucket, and a refused start beside another runner of a new folder."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from mmenc_cli.errors import ModelLoadError, OutputError
from mmenc_cli.output import OutDir
from mmenc_cli.output.fs import read_json
from mmenc_cli.output.task import TaskOutput, _remove_if_only_locks
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg


def manifest(path: Path, n: int = 12) -> Path:
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(n)))
    return path


def test_a_listing_that_fails_at_close_is_exit_3_and_the_task_still_closes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_cfg([manifest(tmp_path / "m.jsonl")], tmp_path / "out")
    real = TaskOutput._lost

    def failing(self: TaskOutput) -> Any:
        def listing(*args: Any, **kw: Any) -> Any:
            raise OSError("the store did not answer")

        monkeypatch.setattr(self.out, "shards", listing)
        return real(self)

    monkeypatch.setattr(TaskOutput, "_lost", failing)
    with pytest.raises(OutputError, match="cannot check that the shards"):
        run_encode(cfg, encoder_factory=factory(FakeEncoder()))
    od = OutDir(tmp_path / "out")
    assert read_json(od.task_meta_path(0))["state"] == "failed"  # recorded, the report closed, the lock let go
    monkeypatch.setattr(TaskOutput, "_lost", real)
    again = run_encode(cfg, encoder_factory=factory(FakeEncoder()))
    assert again.state == "done" and again.counters.encoded_now == 0


def broken(*args: Any, **kw: Any) -> Any:
    raise ModelLoadError("this model cannot load")


def test_a_refused_start_after_overwrite_in_a_bucket_leaves_no_record(tmp_path: Path) -> None:
    m = manifest(tmp_path / "m.jsonl")
    out = f"memory://bkt-{uuid.uuid4().hex}/emb"
    assert run_encode(make_cfg([m], out), encoder_factory=factory(FakeEncoder())).state == "done"
    od = OutDir(out)
    assert read_json(od.task_meta_path(0))["state"] == "done"
    with pytest.raises(ModelLoadError):
        run_encode(make_cfg([m], out, overwrite=True), encoder_factory=broken)
    assert read_json(od.task_meta_path(0)) is None  # not the wiped output's "done"
    assert od.read_run_meta() is None and not od.shards()


def test_a_refused_start_keeps_a_new_folder_another_runner_holds(tmp_path: Path) -> None:
    od = OutDir(tmp_path / "out")
    od.prepare()
    own, other = od.lock_path(0), od.lock_path(1)
    own.write_text("")
    other.write_text("")  # a task that started beside it, still loading its model
    _remove_if_only_locks(od, own)
    assert other.exists()
    other.unlink()
    _remove_if_only_locks(od, own)
    assert not (tmp_path / "out").exists()
