"""Helpers for integration tests against the local Slurm test cluster.

The cluster is started by ``.ci/slurm/up.sh`` (one node on localhost, Slurm
22.05, accounting off, ``MinJobAge=300`` so finished jobs stay visible to
``scontrol`` for five minutes).  This is a plain module, not a conftest::

    from tests.slurm_cluster import require_slurm, run_sbatch, wait_for_job

    @pytest.mark.slurm
    def test_array(tmp_path):
        require_slurm()
        job = run_sbatch(script, "--array=0-2", cwd=tmp_path)
        assert wait_for_job(job, timeout=120) == "COMPLETED"
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

__all__ = [
    "TERMINAL_STATES",
    "USABLE_NODE_STATES",
    "job_states",
    "require_slurm",
    "run_sbatch",
    "slurm_available",
    "slurm_unavailable_reason",
    "wait_for_job",
    "wait_for_job_states",
]

#: Node states (``sinfo %T``) in which the node accepts work.  A trailing
#: ``*`` (not responding), ``~`` (powered off), ``#``/``%``/``!`` etc. make a
#: state unusable, so the comparison is exact.
USABLE_NODE_STATES = frozenset({"idle", "mixed", "allocated", "completing"})

#: Job states after which a job (or array task) will not change any more
#: (unless requeued by hand).
TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)

_CMD_TIMEOUT = 30.0


def _run(
    args: Sequence[str],
    timeout: float = _CMD_TIMEOUT,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
        cwd=cwd,
        env=dict(env) if env is not None else None,
    )


def slurm_unavailable_reason() -> str | None:
    """Return why Slurm cannot run jobs here, or ``None`` when it can."""
    for tool in ("sinfo", "sbatch", "scontrol", "squeue"):
        if shutil.which(tool) is None:
            return f"{tool} not found on PATH"
    try:
        res = _run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if res.returncode != 0:
        return f"sinfo exited {res.returncode}: {res.stderr.strip()}"
    nodes = [line.split() for line in res.stdout.splitlines() if line.strip()]
    if not nodes:
        return "sinfo lists no nodes"
    if not any(len(n) == 2 and n[1] in USABLE_NODE_STATES for n in nodes):
        states = ", ".join(" ".join(n) for n in nodes)
        return f"no node is idle/mixed/allocated ({states})"
    return None


def slurm_available() -> bool:
    """True when ``sinfo`` works and at least one node can take jobs."""
    return slurm_unavailable_reason() is None


def require_slurm() -> None:
    """Skip the calling test when Slurm is not usable; fail it under ``CI=true``.

    In CI the cluster is started by ``.ci/slurm/up.sh`` before pytest, so a
    missing cluster is a setup bug that must not hide behind a skip.
    """
    reason = slurm_unavailable_reason()
    if reason is None:
        return
    msg = f"Slurm cluster not available: {reason} (start it with `bash .ci/slurm/up.sh`)"
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def run_sbatch(
    script: str | os.PathLike[str] | None = None,
    *args: str,
    wrap: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """Submit a batch script (or ``wrap`` command) and return its job id.

    ``args`` are extra sbatch options, e.g. ``"--array=0-2"``.  The job
    inherits ``env`` (default: this process's environment) and runs in ``cwd``
    (default: the current directory), as sbatch does by default.
    """
    if (script is None) == (wrap is None):
        raise ValueError("give exactly one of script or wrap")
    cmd = ["sbatch", "--parsable", *args]
    if wrap is not None:
        cmd += ["--wrap", wrap]
    elif script is not None:
        cmd.append(str(Path(script).resolve()))
    res = _run(cmd, cwd=cwd, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr.strip()}")
    # --parsable prints "jobid" or "jobid;cluster".
    job_id = res.stdout.strip().split(";", 1)[0]
    if not job_id.isdigit():
        raise RuntimeError(f"unexpected sbatch output: {res.stdout!r} {res.stderr!r}")
    return job_id


def _expand_task_ids(spec: str) -> list[str]:
    """Expand an ArrayTaskId spec such as ``3``, ``0-4``, ``1,3-5:2%2``."""
    spec = spec.split("%", 1)[0]
    out: list[str] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            out.append(part)
            continue
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        step = int(m.group(3)) if m.group(3) else 1
        out.extend(str(i) for i in range(lo, hi + 1, step))
    return out


def _field(record: str, key: str) -> str | None:
    m = re.search(rf"(?:^|\s){key}=(\S*)", record)
    return m.group(1) if m else None


def job_states(job_id: str) -> dict[str, str]:
    """Current state of a job, per array task, from ``scontrol show job``.

    Keys are ``"<job>_<task>"`` for array tasks (pending ranges are expanded)
    and ``"<job>"`` for plain jobs.  Returns ``{}`` once the controller has
    forgotten the job (``MinJobAge`` after it ended).
    """
    res = _run(["scontrol", "-o", "show", "job", str(job_id)])
    if res.returncode != 0:
        if "Invalid job id" in res.stderr:
            return {}
        raise RuntimeError(f"scontrol show job {job_id} failed: {res.stderr.strip()}")
    states: dict[str, str] = {}
    for record in res.stdout.splitlines():
        if not record.strip():
            continue
        state = _field(record, "JobState") or "UNKNOWN"
        array_id = _field(record, "ArrayJobId")
        task_spec = _field(record, "ArrayTaskId")
        if array_id and task_spec:
            for task in _expand_task_ids(task_spec):
                states[f"{array_id}_{task}"] = state
        else:
            states[_field(record, "JobId") or str(job_id)] = state
    return states


def _task_sort_key(key: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else -1 for p in key.split("_"))


def wait_for_job_states(
    job_id: str, timeout: float, poll: float = 0.5, cancel_on_timeout: bool = True
) -> dict[str, str]:
    """Wait until the job and all its array tasks reached a terminal state.

    Returns ``{task_key: state}`` as in :func:`job_states`.  On timeout the job
    is cancelled (unless ``cancel_on_timeout`` is false) and ``TimeoutError``
    is raised with the last states seen.
    """
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    while True:
        states = job_states(job_id)
        if states:
            last = states
            if all(s in TERMINAL_STATES for s in states.values()):
                return dict(sorted(states.items(), key=lambda kv: _task_sort_key(kv[0])))
        else:
            # Controller forgot the job: it left the queue long ago.
            queued = _run(["squeue", "-h", "-j", str(job_id), "-o", "%i"])
            if queued.returncode != 0 or not queued.stdout.strip():
                return last or {str(job_id): "UNKNOWN"}
        if time.monotonic() >= deadline:
            if cancel_on_timeout:
                _run(["scancel", str(job_id)])
            raise TimeoutError(f"Slurm job {job_id} not finished after {timeout:.0f}s; states: {last}")
        time.sleep(poll)


def wait_for_job(job_id: str, timeout: float) -> str:
    """Wait for a job (all array tasks) to finish and summarize its state.

    Returns the common state (e.g. ``"COMPLETED"``) when every task ended the
    same way, else a comma-separated per-task list such as
    ``"7_0=COMPLETED,7_1=FAILED,7_2=COMPLETED"``.  Raises ``TimeoutError``.
    """
    states = wait_for_job_states(job_id, timeout)
    distinct = set(states.values())
    if len(distinct) == 1:
        return distinct.pop()
    return ",".join(f"{k}={v}" for k, v in states.items())
