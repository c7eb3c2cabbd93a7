"""Faults of the output: a disk that fills up or turns read-only mid-run ends the run (exit 3)
without turning items into permanent failures; damaged or missing outputs are named by
`inspect`, `status` and a resuming `encode`, never an internal error."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.errors import OutputError
from mmenc_cli.output import OutDir
from mmenc_cli.output.report import ErrorReportWriter, cut_torn_tail, iter_error_records
from mmenc_cli.run.pipeline import run_encode
from mmenc_cli.output.status import collect_status
from mmenc_cli.writers.parquet_shards import ParquetShardWriter
from tests.conftest import write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import embeddings, error_rows, make_cfg

runner = CliRunner()


def manifest(tmp_path: Path, n: int = 30, bad: int = 0) -> Path:
    rows = [{"id": f"t{i}", "text": f"text {i}"} for i in range(n)]
    rows += [{"id": f"bad{i}", "image": f"missing{i}.png"} for i in range(bad)]
    return write_jsonl(tmp_path / "m.jsonl", rows)


def task_meta(out: Path) -> dict:
    return json.loads((out / "_mmenc" / "tasks" / "task-00000.json").read_text())


def fail_shard(monkeypatch: pytest.MonkeyPatch, at: int, err: int) -> dict:
    """Make the `at`-th shard write (and every later one) fail as a full or read-only disk would."""
    real, calls = OutDir.publish_shard, {"n": 0}

    def publish_shard(self, name, content):
        calls["n"] += 1
        if calls["n"] >= at:
            raise OSError(err, os_strerror(err), str(self.tmp_path(name)))
        return real(self, name, content)

    monkeypatch.setattr(OutDir, "publish_shard", publish_shard)
    return calls


def os_strerror(err: int) -> str:
    import os

    return os.strerror(err)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_an_output_fault_ends_the_run_and_a_rerun_finishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           err: int) -> None:
    src, out = manifest(tmp_path, 30, bad=2), tmp_path / "out"
    fail_shard(monkeypatch, at=3, err=err)
    with pytest.raises(OutputError) as caught:
        run_encode(make_cfg([src], out, shard_size=5), encoder_factory=factory(FakeEncoder()))
    message = str(caught.value)
    assert "part-t00000-w00-000002.parquet" in message and errno.errorcode[err] in message
    meta = task_meta(out)
    assert meta["state"] == "failed" and meta["error"] == message and meta["counters"]["balanced"]
    assert meta["counters"]["not_attempted"] > 0
    assert not [r for r in error_rows(out) if r["reason"] == "write.failed"]  # nothing permanent
    status = collect_status(out)
    assert not status.ok and status.rerun == [0] and "failed" in status.tasks[0].reason
    monkeypatch.undo()  # the space is freed
    again = run_encode(make_cfg([src], out, shard_size=5), encoder_factory=factory(FakeEncoder()))
    assert again.state == "done" and again.counters.balanced
    assert len(embeddings(out)) == 30 and len(error_rows(out)) == 2  # the 404s, once each
    assert collect_status(out).ok


def test_the_cli_says_it_in_one_line_with_exit_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fail_shard(monkeypatch, at=1, err=errno.ENOSPC)
    res = runner.invoke(app, ["encode", str(manifest(tmp_path)), "--out", str(tmp_path / "out"), "--device", "cpu",
                              "--progress", "none", "--shard-size", "5"], catch_exceptions=False)
    lines = [line for line in res.stderr.splitlines() if line.startswith("mmenc: error:")]
    assert res.exit_code == 3 and len(lines) == 1 and "No space left on device" in lines[0], res.output
    assert "Traceback" not in res.output


def test_a_report_that_cannot_be_written_ends_the_run_and_loses_no_row(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills while a failure is written: the run ends (exit 3); the torn line is cut off
    when the report is opened again, so the rows before and after it are all readable."""
    src, out = manifest(tmp_path, 10, bad=6), tmp_path / "out"
    real, calls = ErrorReportWriter.write, {"n": 0}

    def write(self, record):
        calls["n"] += 1
        if calls["n"] == 4:  # half a line reaches the disk, then it is full
            self._fh.write(record.to_json()[:20].encode())
            self._fh.flush()
            raise self._fault(OSError(errno.ENOSPC, "No space left on device"))
        return real(self, record)

    monkeypatch.setattr(ErrorReportWriter, "write", write)
    with pytest.raises(OutputError, match="error report"):
        run_encode(make_cfg([src], out), encoder_factory=factory(FakeEncoder()))
    monkeypatch.undo()
    assert task_meta(out)["state"] == "failed" and task_meta(out)["counters"]["balanced"]
    again = run_encode(make_cfg([src], out), encoder_factory=factory(FakeEncoder()))
    assert again.state == "done" and again.counters.balanced
    damaged: list[str] = []
    rows = list(iter_error_records(OutDir(out).error_report_paths(), damaged))
    assert not damaged and len({r["id"] for r in rows}) == 6 and len(embeddings(out)) == 10


def test_a_report_that_fails_mid_chunk_leaves_the_chunk_s_rest_not_attempted(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An image's error row cannot be written while the rest of its decode chunk waits: those
    images are counted "not attempted" (the accounting holds) and a re-run encodes them."""
    from tests.conftest import make_image

    rows = [{"id": f"i{i}", "image": make_image(tmp_path / f"{i}.png", seed=i).name if i != 2 else "gone.png"}
            for i in range(8)]
    src, out = write_jsonl(tmp_path / "m.jsonl", rows), tmp_path / "out"

    def write(self, record):
        raise self._fault(OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(ErrorReportWriter, "write", write)
    with pytest.raises(OutputError, match="error report"):
        run_encode(make_cfg([src], out, batch_size=8), encoder_factory=factory(FakeEncoder()))
    monkeypatch.undo()
    meta = task_meta(out)
    assert meta["state"] == "failed" and meta["counters"]["balanced"], meta["counters"]
    assert meta["counters"]["modalities"]["image"]["not_attempted"] == 8
    again = run_encode(make_cfg([src], out, batch_size=8), encoder_factory=factory(FakeEncoder()))
    assert again.state == "done" and again.counters.balanced and len(embeddings(out)) == 7


def test_a_torn_tail_is_cut_off(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')
    assert cut_torn_tail(path) == 6 and path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert cut_torn_tail(path) == 0
    path.write_bytes(b'{"torn"')
    assert cut_torn_tail(path) == 7 and path.read_bytes() == b""


def test_a_full_disk_at_the_start_is_exit_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mmenc_cli.output.fs import LocalFS

    def full(self, path, content):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(LocalFS, "create", full)
    res = runner.invoke(app, ["encode", str(manifest(tmp_path)), "--out", str(tmp_path / "out"), "--device", "cpu",
                              "--progress", "none"], catch_exceptions=False)
    assert res.exit_code == 3 and "No space left on device" in res.stderr and "run.json" in res.stderr


def encoded_output(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    res = run_encode(make_cfg([manifest(tmp_path, 30)], out, shard_size=5), encoder_factory=factory(FakeEncoder()))
    assert res.state == "done" and len(OutDir(out).shards()) == 6
    return out


def inspect(out: Path) -> tuple[int, str]:
    res = runner.invoke(app, ["inspect", str(out)], catch_exceptions=False)
    return res.exit_code, res.stderr


def status(out: Path) -> tuple[int, str]:
    res = runner.invoke(app, ["status", str(out), "--json"], catch_exceptions=False)
    return res.exit_code, res.stdout


def test_a_deleted_shard_is_named_and_a_rerun_encodes_its_items_again(tmp_path: Path) -> None:
    out = encoded_output(tmp_path)
    gone = OutDir(out).shards()[2]
    gone.unlink()
    code, err = inspect(out)
    assert code == 3 and gone.name in err and "missing" in err
    code, text = status(out)
    report = json.loads(text)
    assert code == 4 and not report["all_done"] and report["rerun"] == [0]
    assert any(gone.name in p for p in report["problems"])
    again = run_encode(make_cfg([manifest(tmp_path, 30)], out, shard_size=5), encoder_factory=factory(FakeEncoder()))
    assert again.counters.mod("text").encoded == 5 and again.counters.mod("text").encoded_before == 25
    assert len(embeddings(out)) == 30 and inspect(out)[0] == 0 and status(out)[0] == 0


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_damaged_or_foreign_shard_is_named_everywhere(tmp_path: Path, damage: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = encoded_output(tmp_path)
    shard = OutDir(out).shards()[1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        shard = out / "part-t00000-w00-000042.parquet"
        pq.write_table(pa.table({"x": [1, 2]}), shard)
    assert inspect(out)[0] == 3 and shard.name in inspect(out)[1]
    code, text = status(out)
    assert code == 4 and any(shard.name in p for p in json.loads(text)["problems"])
    with pytest.raises(OutputError, match=shard.name):  # a resuming run names it (exit 3)
        run_encode(make_cfg([tmp_path / "m.jsonl"], out, shard_size=5), encoder_factory=factory(FakeEncoder()))
    errors = runner.invoke(app, ["errors", "summary", str(out), "--json"], catch_exceptions=False)
    assert errors.exit_code == 0


@pytest.mark.parametrize("content", ["[]", "{not json", ""])
def test_a_damaged_run_json_is_never_all_done(tmp_path: Path, content: str) -> None:
    out = encoded_output(tmp_path)
    (out / "_mmenc" / "run.json").write_text(content)
    code, text = status(out)
    assert code == 4 and not json.loads(text)["all_done"] and "run.json" in " ".join(json.loads(text)["problems"])
    assert inspect(out)[0] == 3
    res = runner.invoke(app, ["encode", str(tmp_path / "m.jsonl"), "--out", str(out), "--device", "cpu",
                              "--progress", "none"], catch_exceptions=False)
    assert res.exit_code == 3 and "run.json" in res.stderr and "internal error" not in res.stderr


def test_an_undecodable_report_line_is_named_and_the_rest_still_read(tmp_path: Path) -> None:
    src, out = manifest(tmp_path, 5, bad=3), tmp_path / "out"
    run_encode(make_cfg([src], out), encoder_factory=factory(FakeEncoder()))
    report = OutDir(out).error_report_paths()[0]
    lines = report.read_bytes().splitlines(keepends=True)
    report.write_bytes(lines[0] + b'{"id": "\xff\xfe broken"}\n' + b"".join(lines[1:]))
    listed = runner.invoke(app, ["errors", "list", str(out), "--json"], catch_exceptions=False)
    assert listed.exit_code == 0 and len(listed.stdout.splitlines()) == 3
    code, text = status(out)
    assert code == 4 and any("line 2" in p and report.name in p for p in json.loads(text)["problems"])
    assert inspect(out)[0] == 3


def test_an_invalid_line_repaired_later_no_longer_counts(tmp_path: Path) -> None:
    """The manifest's bad line is fixed in place (same offset); the next run encodes it and the
    earlier error no longer counts in `errors summary` or `status`."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": 5}\n{"id": "c", "text": "three"}\n')
    out = tmp_path / "out"
    run_encode(make_cfg([path], out), encoder_factory=factory(FakeEncoder()))
    summary = runner.invoke(app, ["errors", "summary", str(out), "--json"], catch_exceptions=False)
    assert json.loads(summary.stdout)["errors"] == 1
    path.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": "5"}\n{"id": "c", "text": "three"}\n')
    again = run_encode(make_cfg([path], out), encoder_factory=factory(FakeEncoder()))
    assert again.counters.mod("text").encoded == 1 and again.counters.invalid_before == 0
    summary = runner.invoke(app, ["errors", "summary", str(out), "--json"], catch_exceptions=False)
    assert json.loads(summary.stdout)["errors"] == 0 and collect_status(out).tasks[0].errors == 0
    third = run_encode(make_cfg([path], out), encoder_factory=factory(FakeEncoder()))
    assert third.counters.mod("text").encoded_before == 3
    assert sum(1 for r in error_rows(out) if r.get("status") == "resolved") == 1  # marked once


def test_revision_with_a_local_folder_is_refused(tmp_path: Path, tiny_st: Path) -> None:
    res = runner.invoke(app, ["encode", str(manifest(tmp_path)), "--out", str(tmp_path / "out"), "--model", str(tiny_st),
                              "--revision", "v2", "--device", "cpu", "--progress", "none"], catch_exceptions=False)
    assert res.exit_code == 2 and "--revision" in res.stderr and "local folder" in res.stderr


@pytest.mark.slow
def test_a_device_that_fails_is_the_one_named(tmp_path: Path, tiny_st: Path) -> None:
    """`--device cuda:0,cpu` without CUDA: the cuda:0 worker fails and is named; the CPU worker
    resolves its own device and dtype, so it does not fail on cuda:0's behalf."""
    from mmenc_cli.config import ModelConfig, RunConfig, WriterConfig
    from mmenc_cli.errors import RunError

    cfg = RunConfig(manifests=(str(manifest(tmp_path, 8)),), writer=WriterConfig(out=str(tmp_path / "out")),
                    model=ModelConfig(model=str(tiny_st), device="cuda:0,cpu"))
    with pytest.raises(RunError) as caught:
        run_encode(cfg)
    message = str(caught.value)
    assert caught.value.exit_code == 3 and "device worker 0 (cuda:0)" in message and "CUDA" in message
    assert "device worker 1" not in message
