"""`engines/job.py` without Ray: each task's code, the job's result summed over its tasks, the error
thresholds judged on the job (not on each task), and the job's exit code from its tasks' outcomes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mmenc_cli.engines.job import LOST, JobSpec, TaskOutcome, job_exit_code, merge_results, task_code
from mmenc_cli.run.counters import Counters, RunResult
from tests.runs import make_cfg


def counted(encoded: int, failed: int = 0, not_attempted: int = 0) -> Counters:
    """Counters of a run that encoded, failed and left items (422s) as said: balanced."""
    c = Counters()
    c.add_row("rows", encoded + failed + not_attempted)
    c.add("text", "requested", encoded + failed + not_attempted)
    c.add("text", "encoded", encoded)
    c.add("text", "not_attempted", not_attempted)
    for _ in range(failed):
        c.add_failure("text", 422)
    return c


def result(task: int, state: str = "done", **counts: int) -> RunResult:
    return RunResult(out="/out", task=task, state=state, counters=counted(**counts), facts={"dim": 8}, elapsed=1.0,
                     model_loaded=True)


def done(task: int, **counts: int) -> TaskOutcome:
    return TaskOutcome(task=task, code=0, state="done", result=result(task, **counts))


@pytest.fixture
def spec(tmp_path: Path) -> JobSpec:
    cfg = make_cfg([tmp_path / "m.jsonl"], tmp_path / "out")
    return JobSpec(cfg=replace(cfg, max_errors=2), tasks=3)


def test_a_task_runs_its_slice_without_the_job_s_thresholds_and_waits_for_a_live_runner(spec: JobSpec) -> None:
    cfg = spec.task_config(2)
    assert (cfg.task_index, cfg.task_count) == (2, 3)
    assert cfg.max_errors is None and cfg.max_error_rate is None and cfg.wait_lock and not cfg.overwrite
    assert spec.cfg.max_errors == 2  # the job keeps them


def test_each_task_s_own_code() -> None:
    assert task_code(result(0, encoded=5, failed=1)) == 0
    assert task_code(result(0, state="stopped", encoded=1, failed=1, not_attempted=3)) == 4
    assert task_code(result(0, state="interrupted", encoded=1, not_attempted=3)) == 143
    unbalanced = result(0, encoded=5)
    unbalanced.counters.add("text", "requested", 1)
    assert task_code(unbalanced) == 1


def test_the_threshold_applies_to_the_job_across_tasks(spec: JobSpec) -> None:
    outcomes = [done(t, encoded=9, failed=1) for t in range(3)]  # each task alone is within --max-errors 2
    merged = merge_results(spec, outcomes, elapsed=3.0)
    assert merged.counters.failed == 3 and merged.counters.encoded == 27 and merged.counters.balanced
    assert merged.threshold_exceeded == "3 errors > --max-errors 2"
    assert job_exit_code(outcomes, merged, status_ok=True) == (4, "error threshold exceeded: 3 errors > --max-errors 2")
    within = merge_results(replace(spec, cfg=replace(spec.cfg, max_errors=3)), outcomes, elapsed=3.0)
    assert within.threshold_exceeded is None and job_exit_code(outcomes, within, status_ok=True) == (0, None)


def test_the_error_rate_is_the_job_s_too(spec: JobSpec) -> None:
    rated = replace(spec, cfg=replace(spec.cfg, max_errors=None, max_error_rate=0.1))
    outcomes = [done(0, encoded=10, failed=3), done(1, encoded=90), done(2, encoded=97)]  # task 0 alone: 23%
    assert merge_results(rated, outcomes, 1.0).threshold_exceeded is None  # 3 of 200: 1.5%
    outcomes[1] = done(1, encoded=5, failed=20)
    assert merge_results(rated, outcomes, 1.0).threshold_exceeded == "error rate 17.04% > --max-error-rate 10.00%"  # 23 of 135


def test_the_first_failed_task_gives_the_job_its_code(spec: JobSpec) -> None:
    outcomes = [done(0, encoded=5), TaskOutcome(task=2, code=3, state="failed", error="bucket refuses writes"),
                TaskOutcome(task=1, code=LOST, state="lost", error="its worker died")]
    merged = merge_results(spec, outcomes, 1.0)
    assert merged.state == "failed" and merged.counters.encoded == 5
    assert job_exit_code(outcomes, merged) == (LOST, "task 1 lost: its worker died")
    outcomes[2] = replace(outcomes[2], code=75, state="failed", error="another runner holds it")
    assert job_exit_code(outcomes, merged) == (75, "task 1 failed: another runner holds it")
    assert job_exit_code(outcomes[:2], merged) == (3, "task 2 failed: bucket refuses writes")


def test_a_failed_task_outranks_the_threshold_and_a_signal_outranks_everything(spec: JobSpec) -> None:
    outcomes = [done(0, encoded=1, failed=9), TaskOutcome(task=1, code=2, state="failed", error="bad option")]
    merged = merge_results(spec, outcomes, 1.0)
    assert merged.threshold_exceeded and job_exit_code(outcomes, merged)[0] == 2
    assert job_exit_code(outcomes, merged, signum=15)[0] == 143


def test_a_fail_fast_stop_is_4_and_the_tasks_it_cancelled_are_no_failure(spec: JobSpec) -> None:
    outcomes = [TaskOutcome(task=0, code=4, state="stopped", result=result(0, "stopped", encoded=2, failed=1)),
                TaskOutcome(task=1, code=130, state="cancelled"), done(2, encoded=4)]
    merged = merge_results(spec, outcomes, 1.0)
    assert merged.state == "stopped"
    assert job_exit_code(outcomes, merged) == (4, "task 0 stopped at its first failed item (--fail-fast)")


def test_a_job_whose_counts_do_not_balance_is_a_bug_and_status_left_work_is_4(spec: JobSpec) -> None:
    outcomes = [done(0, encoded=5)]
    merged = merge_results(spec, outcomes, 1.0)
    assert job_exit_code(outcomes, merged, status_ok=False)[0] == 4
    assert job_exit_code(outcomes, merged, status_ok=None) == (0, None)  # status not read: not held against it
    merged.counters.add("text", "requested", 1)
    assert job_exit_code(outcomes, merged) == (1, "the job's counts do not balance")


def test_the_json_result_names_every_task(spec: JobSpec) -> None:
    from mmenc_cli.engines.job import JobResult

    outcomes = [done(0, encoded=5), TaskOutcome(task=1, code=LOST, state="lost", attempts=4, host="n1")]
    job = JobResult(tasks=outcomes, result=merge_results(spec, outcomes, 1.0), code=LOST, reason="task 1 lost")
    d = job.to_dict()
    assert [t["state"] for t in d["tasks"]] == ["done", "lost"] and d["tasks"][1]["attempts"] == 4
    assert d["exit_code"] == LOST and d["counters"]["encoded"] == 5 and d["tasks"][1]["counters"] is None


def test_the_jobs_size_is_every_slice_and_the_display_shares_it(tmp_path: Path, monkeypatch: Any) -> None:
    """`mmenc ray` shows a percentage of the whole job from the start: a task that has not reported
    yet counts as not done, not as absent."""
    pytest.importorskip("ray")
    from mmenc_cli.engines import ray_driver
    from mmenc_cli.engines.job import job_size
    from mmenc_cli.readers import plan
    from mmenc_cli.readers.slicing import Reading
    from mmenc_cli.run.counters import Counters

    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(100)))
    cfg = make_cfg([m], tmp_path / "out")
    total = job_size(plan([str(m)]), cfg, 4)
    assert total is not None and total.total == m.stat().st_size and total.done == 0
    first = Counters()
    first.reading = Reading(total=total.total // 4, done=total.total // 4)  # task 0 read its whole slice
    first.add("text", "requested")
    first.add("text", "encoded")
    monkeypatch.setattr(ray_driver, "_snapshot", lambda board: {0: {"counters": first}})
    counters, note = ray_driver._progress(None, {}, 4, total)
    assert counters.progress == {"done": total.total // 4, "total": total.total, "unit": "bytes"}
    assert "0/4 done" in note
    gz = tmp_path / "m.jsonl.gz"
    gz.write_bytes(b"")
    assert job_size(plan([str(gz)]), cfg, 2) is None  # a size no listing tells: no percentage
