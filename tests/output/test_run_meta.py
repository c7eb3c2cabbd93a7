"""run.json read a second time: an output that holds shards had one (another task may have written
it and a shard just after this one looked, or a store may show it late), so a first read that
finds none is checked again before the run is refused."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from mmenc_cli.errors import OutputError
from mmenc_cli.output import OutDir, admit
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg


def manifest(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(12)))
    return path


def encode(m: Path, out: str) -> Any:
    return run_encode(make_cfg([m], out), encoder_factory=factory(FakeEncoder()))


@pytest.fixture
def bucket_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    monkeypatch.setattr(admit.time, "sleep", lambda s: None)
    m = manifest(tmp_path / "m.jsonl")
    out = f"memory://bkt-{uuid.uuid4().hex}/emb"
    assert encode(m, out).counters.encoded_now == 12
    return m, out


def test_a_run_json_seen_late_is_read_again(bucket_output: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    m, out = bucket_output
    real, misses = OutDir.read_run_meta, [2]

    def read_run_meta(od: OutDir) -> Any:
        if misses[0]:
            misses[0] -= 1
            return None
        return real(od)

    monkeypatch.setattr(OutDir, "read_run_meta", read_run_meta)
    again = encode(m, out)
    assert again.counters.encoded_now == 0 and again.counters.mod("text").encoded_before == 12


def test_shards_without_run_json_are_refused_after_the_second_look(bucket_output: tuple[Path, str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    m, out = bucket_output
    OutDir(out).run_meta_path.unlink()
    with pytest.raises(OutputError, match="holds shards but no run.json"):
        encode(m, out)


def test_a_task_that_looked_just_before_another_wrote_run_json_goes_on(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    m = manifest(tmp_path / "m.jsonl")
    out = str(tmp_path / "out")
    encode(m, out)  # "the other task": run.json and shards, written while this one looked
    real, first = OutDir.read_run_meta, [True]

    def read_run_meta(od: OutDir) -> Any:
        if first[0]:
            first[0] = False
            return None
        return real(od)

    monkeypatch.setattr(OutDir, "read_run_meta", read_run_meta)
    assert encode(m, out).counters.mod("text").encoded_before == 12
