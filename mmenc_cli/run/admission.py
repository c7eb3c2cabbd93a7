"""The run's side of opening a task (`output.task.Admission`): its fingerprint, how it judges the
one an output was written with, and the run.json of a new output.

Resolved before the fingerprint: the compute dtype for the device, `--decode` (the mode the
output was written with when not given), and the extras `--decode gpu` and audio or video need
(a clear error before a model is loaded for nothing). The decode workers' forkserver starts here
when it pays, so its imports overlap the model's load.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable

from ..config import RunConfig
from ..encoders.base import Encoder
from ..encoders.device_decode import jpeg_decoder
from ..clock import timestamp
from ..errors import OutputError
from ..media.clips import require_av
from .decode_pool import start_forkserver, workers_start_early
from .metadata import (
    decode_mode,
    fingerprint,
    fingerprint_diff,
    library_versions,
    model_facts,
    resolved_dtype,
    version_changes,
)

log = logging.getLogger("mmenc")


class RunAdmission:
    """How a run opens its task (see the module docstring): `cfg` is the run's config, with
    `--decode` settled once the output's run.json has been read; `load_encoder` loads the model
    (a new output's facts need it)."""

    def __init__(self, cfg: RunConfig, device: str, load_encoder: Callable[[], Encoder]) -> None:
        self.cfg, self.device, self.load_encoder = cfg, device, load_encoder
        self.dtype = "float32"

    def fingerprint(self, recorded: dict[str, Any] | None) -> dict[str, Any]:
        cfg = self.cfg
        self.dtype = resolved_dtype(cfg, self.device)
        if cfg.media.decode == "gpu":
            jpeg_decoder()  # the extra is installed, or a clear error before anything else
        if {"audio", "video"} & set(cfg.modalities or ()):
            require_av()  # likewise, before a model is loaded for nothing
        if cfg.media.decode is None:  # settled once: what the output was written with, or fast
            self.cfg = cfg = replace(cfg, media=replace(cfg.media, decode=decode_mode(cfg, recorded)))
        if workers_start_early(cfg, self.device):  # their imports overlap the model's load
            start_forkserver(torch=True)
        return fingerprint(cfg, self.dtype)

    def judge(self, recorded: dict[str, Any], fp: dict[str, Any]) -> list[str]:
        check_task_count(self.cfg, recorded)
        model = self.cfg.model.model
        diff = [f"model {model}: its files are not those the output was written with" if d.startswith("model_stamp:")
                else d for d in fingerprint_diff(recorded.get("fingerprint", {}), fp, model)]
        if not diff:
            for name, was, now in version_changes(recorded.get("versions")):  # a routine upgrade: go on, say so
                log.warning("%s was started with %s %s, this run has %s %s: resuming; vectors made by the two "
                            "versions may differ slightly", self.cfg.writer.out, name, was, name, now)
        return diff

    def create(self, fp: dict[str, Any]) -> dict[str, Any]:
        facts = model_facts(self.cfg, self.load_encoder(), self.dtype)
        return {"fingerprint": fp, "facts": facts, "config": self.cfg.to_dict(), "created": timestamp(),
                "versions": library_versions()}


def check_task_count(cfg: RunConfig, recorded: dict[str, Any]) -> None:
    """An output is split into tasks one way: the task count it was started with. A run that slices
    the input another way would encode items that a task of the other split is encoding (or has
    encoded) too, so it is refused, whatever the engine that started it."""
    was = (recorded.get("config") or {}).get("task_count")
    if not isinstance(was, int) or was == cfg.task_count:
        return
    raise OutputError(f"{cfg.writer.out} was started with {was} task{'s' if was != 1 else ''}, and this run is task "
                      f"{cfg.task_index} of {cfg.task_count}: an output is split one way; run its tasks with "
                      f"--task-count {was} (Slurm --tasks {was}, Ray --tasks {was}, MMENC_TASK_COUNT={was}), or "
                      "re-slice into a new --out, or start over with --overwrite")


def check_commit(root: str, model: str, facts: dict[str, Any], info: dict[str, Any]) -> None:
    """A hub id's fingerprint names the requested revision ("main" moves): the commit the model
    actually came from must be the one the output was started with, or vectors would mix."""
    was, now = facts.get("commit"), info.get("commit")
    if was and now and was != now:
        raise OutputError(f"{model} now resolves to commit {now}, but {root} was written with commit "
                          f"{was}: pin --revision {was}, use another --out, or --overwrite to start over")
