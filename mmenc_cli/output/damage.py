"""What is damaged in an output folder, named with what to do: the checks `mmenc inspect` and
`mmenc status` share (shards themselves are checked where they are read)."""

from __future__ import annotations

from .report import iter_error_records
from .outdir import OutDir, parse_shard_name, read_json
from .shardlog import missing_shards, read_logs


def run_meta_problem(od: OutDir) -> str | None:
    """What is wrong with `run.json`: damaged, or missing beside shards; None when it is fine."""
    if od.run_meta_path.exists():
        if not isinstance(od.read_run_meta(), dict):
            return (f"{od.run_meta_path} is damaged (not the run's options and facts): restore it, or start "
                    "over with --overwrite")
    elif od.shards():
        return f"{od.run_meta_path} is missing though OUT holds shards: not an mmenc output, or damaged"
    return None


def task_meta_problems(od: OutDir) -> list[str]:
    """Task records that cannot be read."""
    return [f"{path} is damaged (not a task record): re-run that task to write it again"
            for _, path in od.task_meta_paths() if not isinstance(read_json(path), dict)]


def missing_shard_problems(od: OutDir) -> list[tuple[int, str]]:
    """(task, problem) for each shard a task's log lists as committed that is gone."""
    out = []
    for name in missing_shards(od):
        parsed = parse_shard_name(name)
        task = parsed.task if parsed else -1
        out.append((task, f"shard {od.root / name} was committed by task {task} and is missing: re-run task "
                          f"{task} to encode its items again"))
    return out


def report_problems(od: OutDir) -> list[str]:
    """Error-report lines and shard-log lines that cannot be read."""
    damaged: list[str] = []
    for _ in iter_error_records(od.error_report_paths(), damaged):
        pass
    read_logs(od, damaged)
    return [f"{d}: damaged (the line is skipped)" for d in damaged]


def output_problems(od: OutDir) -> list[str]:
    """Everything above, for `mmenc inspect`."""
    problems = [p for p in [run_meta_problem(od)] if p]
    problems += task_meta_problems(od)
    problems += [p for _, p in missing_shard_problems(od)]
    return problems + report_problems(od)
