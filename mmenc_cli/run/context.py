"""What the stages of one run share, as one record: the config, the task's output, the counters,
the failure sink, the stop event, progress, the encoder (loaded on first use) and what the output
settled. The stages get this, never the run object itself."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..config import RunConfig
from ..encoders.base import Encoder
from ..output.task import TaskOutput
from .counters import Counters
from .failures import FailureSink

ProgressFn = Callable[[Counters], None]


@dataclass
class RunContext:
    """One run's shared state for its stages (see the module docstring)."""

    cfg: RunConfig
    output: TaskOutput
    counters: Counters
    failures: FailureSink
    stop: threading.Event
    progress: ProgressFn
    load_encoder: Callable[[], Encoder]
    facts: dict[str, Any]
    modalities: tuple[str, ...]
    events: list[str]
    #: the batch size settled when the encoder loads (--batch-size, or the device's probe)
    batch_size: int | None = None
