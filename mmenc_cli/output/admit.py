"""Admitting a run to its output: run.json read (looked at again where another task may be writing
it), judged against the run's fingerprint (`task.Admission`), or created for a new output."""

from __future__ import annotations

import time
from typing import Any, Protocol

from ..errors import OutputError
from .outdir import OutDir


class Admission(Protocol):
    """The run's side of opening a task: its fingerprint and how it judges an output's."""

    def fingerprint(self, recorded: dict[str, Any] | None) -> dict[str, Any]:
        """The run's fingerprint, given the output's run.json (None: a new output)."""

    def judge(self, recorded: dict[str, Any], fingerprint: dict[str, Any]) -> list[str]:
        """What differs between the output's run.json and this run's fingerprint (empty: it may
        resume), logging what only deserves a warning."""

    def create(self, fingerprint: dict[str, Any]) -> dict[str, Any]:
        """The run.json of a new output (its facts need the model: this loads it)."""


def recorded_meta(out: OutDir) -> Any:
    """run.json's content (None for a new output). A first read that finds none while OUT holds
    shards looks again: another task may have written run.json and a shard in between, and a
    store with weaker consistency than S3's (or a busy one) may show an object late. OutputError
    when OUT holds shards but still no run.json."""
    recorded = out.read_run_meta()
    if recorded is not None or not out.shards():
        return recorded
    for wait in (0.0, 0.5, 1.0, 2.0) if out.in_store else (0.0,):
        time.sleep(wait)
        recorded = out.read_run_meta()
        if recorded is not None:
            return recorded
    if out.run_meta_path.exists():
        return None  # there but unreadable: damaged
    raise OutputError(f"{out.root} holds shards but no {out.run_meta_path.name}: "
                      "not an mmenc output, or damaged; use --overwrite to start over")


def admit(out: OutDir, admission: Admission) -> tuple[dict[str, Any], bool]:
    """The output's run.json when this run's options match it; a new output's, recorded as its
    new run.json (then True). OutputError when the options differ, or run.json is damaged, or OUT holds
    shards but no run.json."""
    recorded = recorded_meta(out)
    if recorded is not None and not isinstance(recorded, dict) or recorded is None and out.run_meta_path.exists():
        raise OutputError(f"{out.run_meta_path} is damaged (not the run's options and facts): restore it, or "
                          "start over with --overwrite")
    fingerprint = admission.fingerprint(recorded)
    if recorded is None:
        meta = admission.create(fingerprint)
        if out.create_run_meta(meta):
            return meta, True
        recorded = out.read_run_meta() or {}  # another task or device worker was first: ours must match
    diff = admission.judge(recorded, fingerprint)
    if diff:
        raise OutputError(f"{out.root} was written with other options ({'; '.join(diff)}); "
                          "use the same options, another --out, or --overwrite to start over")
    return recorded, False
