"""Progress with a total: the percentage of the task's slice and an ETA from the recent rate, on
the bar and in the log lines, the same across tasks (merged counters), and in `mmenc status`."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.cli.render import Progress, WindowRate, eta_text, setup_logging
from mmenc_cli.readers import Reading
from mmenc_cli.run import pipeline
from mmenc_cli.run.counters import Counters
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg

runner = CliRunner()
PERCENT = re.compile(r"progress: rows \d+, encoded \d+, failed \d+, [\d.]+ items/s, ([\d.]+)%(, ETA \S+)?$")


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counters(done: int, total: int | None, requested: int = 0, encoded: int = 0) -> Counters:
    c = Counters()
    c.reading = Reading(total=total, done=done)
    c.add("text", "requested", requested)
    c.add("text", "encoded", encoded)
    return c


@pytest.mark.parametrize("seconds,text", [(0, "ETA 0s"), (44.6, "ETA 45s"), (59.6, "ETA 1m00s"), (192, "ETA 3m12s"),
                                          (3600, "ETA 1h00m"), (3720, "ETA 1h02m"), (90061, "ETA 25h01m"),
                                          (-3, "ETA 0s")])
def test_eta_text(seconds: float, text: str) -> None:
    assert eta_text(seconds) == text


def test_the_rate_is_the_recent_window_s() -> None:
    clock = Clock()
    rate = WindowRate(window=45.0, clock=clock)
    assert rate.rate() is None
    for _ in range(60):  # a minute at 10 a second
        rate.add(int((clock.now - 1000.0) * 10))
        clock.now += 1.0
    assert rate.rate() == pytest.approx(10.0)
    start = int((clock.now - 1000.0) * 10)
    for i in range(60):  # then a minute at 100 a second: the first minute fades out of the window
        rate.add(start + i * 100)
        clock.now += 1.0
    assert rate.rate() == pytest.approx(100.0)
    assert 2 <= len(rate.samples) <= 48  # a sample a step apart over the window, no more
    for _ in range(50):  # a stall over the whole window: no rate, no ETA
        rate.add(start + 59 * 100)
        clock.now += 1.0
    assert rate.rate() is None


def test_samples_within_a_step_replace_the_newest() -> None:
    clock = Clock()
    rate = WindowRate(clock=clock, step=0.5)
    for i in range(1000):  # a thousand calls in a tenth of a second
        rate.add(i)
        clock.now += 0.0001
    assert len(rate.samples) == 2 and rate.rate() == pytest.approx(999 / 0.0999)


def lines_of(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line.split("INFO: ", 1)[1] for line in capsys.readouterr().err.splitlines() if "INFO: progress" in line]


def test_log_lines_carry_the_percentage_and_the_eta(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging()
    clock = Clock()
    show = Progress("log", 0.0, clock=clock)
    show(counters(0, 1000))
    clock.now += 10.0
    show(counters(100, 1000), note="tasks 0/2 done")  # 10 a second: 900 left is 90 s
    clock.now += 10.0
    show(counters(1000, 1000))
    assert lines_of(capsys) == [
        "progress: rows 0, encoded 0, failed 0, 0.0 items/s, 0.0%",
        "progress: rows 0, encoded 0, failed 0, 0.0 items/s, 10.0%, ETA 1m30s; tasks 0/2 done",
        "progress: rows 0, encoded 0, failed 0, 0.0 items/s, 100.0%, ETA 0s"]


def test_an_unknown_total_shows_what_it_showed_before(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging()
    show = Progress("log", 0.0, clock=Clock())
    show(counters(500, None))
    show(Counters())
    assert lines_of(capsys) == ["progress: rows 0, encoded 0, failed 0, 0.0 items/s"] * 2


def test_the_bar_fills_to_the_total_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    show = Progress("bar", 0.0, clock=clock)
    show(counters(0, 1000))
    clock.now += 5.0
    show(counters(250, 1000))
    task = show.bar.tasks[0]
    assert (task.total, task.completed) == (1000, 250) and "25.0%  ETA 15s" in task.description
    show.close()
    assert capsys.readouterr().out == ""
    unknown = Progress("bar", 0.0, clock=clock)
    unknown(counters(10, None))
    assert unknown.bar.tasks[0].total is None and "%" not in unknown.bar.tasks[0].description
    unknown.close()


def test_items_read_but_not_settled_are_not_done() -> None:
    assert counters(500, 1000, requested=10, encoded=5).progress == {"done": 250, "total": 1000, "unit": "bytes"}
    assert counters(1000, 1000, requested=10, encoded=10).progress == {"done": 1000, "total": 1000, "unit": "bytes"}
    assert counters(300, 1000).progress == {"done": 300, "total": 1000, "unit": "bytes"}  # no item asked yet
    assert counters(0, None).progress is None and Counters().progress is None


def test_tasks_merge_into_one_total() -> None:
    job = Counters()
    for c in (counters(100, 400), counters(300, 600)):
        job.merge(c)
    assert job.progress == {"done": 400, "total": 1000, "unit": "bytes"}
    job.merge(counters(5, None))  # a task whose slice has no known size: the job's is not known
    assert job.progress is None


def progress_run(args: list[Any]) -> list[tuple[float, bool]]:
    """(percentage, has an ETA) of each progress log line of `mmenc encode ARGS --progress log --log-every 0`."""
    res = runner.invoke(app, [str(a) for a in args] + ["--device", "cpu", "--progress", "log", "--log-every", "0",
                                                       "--batch-size", "4"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    found = [PERCENT.search(line) for line in res.stderr.splitlines() if "progress: rows" in line]
    assert found and all(found), res.stderr
    return [(float(m.group(1)), m.group(2) is not None) for m in found if m]


def test_a_jsonl_run_reaches_100_percent_with_an_eta(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"text {i}"} for i in range(40)])
    seen = progress_run(["encode", manifest, "--out", tmp_path / "o"])
    assert seen[-1] == (100.0, True) and any(eta for pct, eta in seen if pct < 100.0)
    assert all(0.0 <= pct <= 100.0 for pct, _ in seen) and len(seen) >= 2  # a line a group of batches


def test_a_parquet_run_reaches_100_percent_with_an_eta(tmp_path: Path) -> None:
    manifest = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": [f"t{i}" for i in range(40)], "text": [f"text {i}" for i in range(40)]}),
                   manifest, row_group_size=8)
    seen = progress_run(["encode", manifest, "--out", tmp_path / "o"])
    assert seen[-1] == (100.0, True) and any(eta for pct, eta in seen if pct < 100.0)


def test_a_jsonl_gz_run_shows_no_percentage(tmp_path: Path) -> None:
    import gzip

    manifest = tmp_path / "m.jsonl.gz"
    with gzip.open(manifest, "wt") as fh:
        fh.writelines(json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(8))
    res = runner.invoke(app, ["encode", str(manifest), "--out", str(tmp_path / "o"), "--device", "cpu",
                              "--progress", "log", "--log-every", "0"], catch_exceptions=False)
    assert res.exit_code == 0 and "progress: rows" in res.stderr and "%" not in res.stderr and "ETA" not in res.stderr


def status_json(out: Path) -> dict[str, Any]:
    res = runner.invoke(app, ["status", str(out), "--json"])
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_a_running_task_s_record_carries_its_progress_for_status(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shard commit writes the running task's record again, with its progress, which
    `mmenc status` shows as the task's percentage."""
    monkeypatch.setattr(pipeline, "RECORD_EVERY", 0.0)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"text {i}"} for i in range(60)])
    out = tmp_path / "out"
    record = out / "_mmenc" / "tasks" / "task-00000.json"
    seen: list[dict[str, Any]] = []

    def look(c: Counters) -> None:  # the progress callback: what a concurrent `mmenc status` reads now
        if record.exists():
            seen.append(json.loads(record.read_text()))

    run_encode(make_cfg([manifest], out, shard_size=10), encoder_factory=factory(FakeEncoder()), progress=look)
    running = [r["progress"] for r in seen if r["state"] == "running" and r.get("progress")]
    assert running and any(0 < p["done"] < p["total"] for p in running), seen
    assert all(p["total"] == manifest.stat().st_size and p["unit"] == "bytes" for p in running)
    final = json.loads(record.read_text())
    assert final["state"] == "done" and final["progress"]["done"] == final["progress"]["total"]
    assert status_json(out)["tasks"][0]["percent"] == 100.0

    final.update(state="running", pid=2 ** 22 + 7, progress={"done": 403, "total": 1000, "unit": "bytes"})
    record.write_text(json.dumps(final))  # a task that died at 40.3% (no process holds its lock)
    task = status_json(out)["tasks"][0]
    assert task["percent"] == 40.3 and task["state"] == "running" and task["needs_rerun"]
    table = runner.invoke(app, ["status", str(out)]).stdout
    assert re.search(r"^ *0 +crashed +40\.3% ", table, re.M), table
