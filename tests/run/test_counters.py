"""Counters have one owner, the encode loop's thread; every item ends in exactly one bucket."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mmenc_cli.run.counters import Counters
from mmenc_cli.run.pipeline import run_encode
from mmenc_cli.writers.parquet_shards import ParquetShardWriter
from tests.conftest import make_image, write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import embeddings, error_rows, make_cfg


def mixed_manifest(tmp_path: Path, n: int = 40) -> Path:
    rows = []
    for i in range(n):
        row = {"id": f"r{i}", "text": f"text number {i}"}
        if i % 2:
            row["image"] = make_image(tmp_path / f"i{i}.png", seed=i).name
        rows.append(row)
    return write_jsonl(tmp_path / "m.jsonl", rows)


def test_only_the_encode_loop_thread_changes_the_counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run with a writer thread (shards of 3) and a shard whose write fails: every change to the
    counters comes from the main thread, and the failed shard's items count as failed, exactly."""
    touched: list[str] = []
    real_touch = Counters._touch

    def touch(self: Counters) -> None:
        touched.append(threading.current_thread().name)
        real_touch(self)

    writes = {"n": 0}
    real_files = ParquetShardWriter.files

    def files(self, data, name):  # the third shard cannot be written (its data, not the disk: see robustness/)
        writes["n"] += 1
        if writes["n"] == 3:
            raise ValueError("this shard's data cannot be written")
        return real_files(self, data, name)

    monkeypatch.setattr(Counters, "_touch", touch)
    monkeypatch.setattr(ParquetShardWriter, "files", files)
    manifest = mixed_manifest(tmp_path)
    res = run_encode(make_cfg([manifest], tmp_path / "out", shard_size=3), encoder_factory=factory(FakeEncoder()))
    assert writes["n"] > 3 and touched and set(touched) == {"MainThread"}
    c = res.counters
    failed = [r for r in error_rows(tmp_path / "out") if r["reason"] == "write.failed"]
    assert len(failed) == 3 and {r["code"] for r in failed} == {500}
    assert c.requested == 60 and c.encoded == 57 and c.failed == 3 and c.not_attempted == 0 and c.balanced
    assert len(embeddings(tmp_path / "out")) == 57


def test_a_change_from_another_thread_is_refused() -> None:
    c = Counters()
    c.add("text", "requested")
    errors: list[BaseException] = []

    def other() -> None:
        try:
            c.add("text", "encoded")
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=other, name="intruder")
    t.start()
    t.join()
    assert errors and "intruder" in str(errors[0]) and c.mod("text").encoded == 0


def test_a_stopped_run_counts_what_it_did_not_attempt_and_a_rerun_finishes(tmp_path: Path) -> None:
    """Stopped after the first batches (as a signal does), the items accepted but not encoded are
    "not attempted": the accounting holds, nothing is an error row, and a re-run encodes them."""
    manifest = mixed_manifest(tmp_path, 60)
    stop = threading.Event()

    def progress(c: Counters) -> None:
        if c.encoded_now >= 8:
            stop.set()

    res = run_encode(make_cfg([manifest], tmp_path / "out", shard_size=4, batch_size=4),
                     encoder_factory=factory(FakeEncoder()), progress=progress, stop=stop)
    c = res.counters
    assert res.state == "interrupted" and c.not_attempted > 0 and c.balanced
    assert c.requested + c.invalid == c.encoded + c.failed + c.not_attempted and c.failed == 0
    assert not error_rows(tmp_path / "out")
    again = run_encode(make_cfg([manifest], tmp_path / "out", shard_size=4, batch_size=4),
                       encoder_factory=factory(FakeEncoder()))
    assert again.state == "done" and again.counters.not_attempted == 0 and again.counters.balanced
    assert len(embeddings(tmp_path / "out")) == 90  # 60 texts + 30 images, each once


def test_a_run_stopped_before_it_starts_records_itself_interrupted(tmp_path: Path) -> None:
    """A stop that lands between taking the task's lock and loading the model (SIGTERM while
    Python starts) ends the run there, and the task metadata says so."""
    import json

    stop = threading.Event()
    stop.set()
    encoder = FakeEncoder()
    res = run_encode(make_cfg([mixed_manifest(tmp_path, 4)], tmp_path / "out"), encoder_factory=factory(encoder),
                     stop=stop)
    assert res.state == "interrupted" and not res.model_loaded and not encoder.batches
    meta = json.loads((tmp_path / "out" / "_mmenc" / "tasks" / "task-00000.json").read_text())
    assert meta["state"] == "interrupted" and meta["model_loaded"] is False and meta["counters"]["balanced"]
