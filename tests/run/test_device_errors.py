"""How a GPU run tells an out-of-memory error and a lost device apart, on the fake CUDA layer.

* out of memory is known by its type (`torch.OutOfMemoryError`, a subclass, a wrapped one) as well
  as by its message: the batch is halved, never bisected into 500 rows;
* a sticky CUDA error first seen when the forward's CUDA-event timer is read (at the end of the
  run, `device_seconds`) ends the run as a `DeviceError` (exit 1) with the task recorded failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from mmenc_cli.batching import BatchRunner
from mmenc_cli.encoders.base import EncodeOutput
from mmenc_cli.encoders.forward import ForwardTimer
from mmenc_cli.errors import DeviceError, classify, is_out_of_memory
from mmenc_cli.output import OutDir
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import embeddings, error_rows, make_cfg

ILLEGAL = "CUDA error: an illegal memory access was encountered"


class RenamedOOM(torch.OutOfMemoryError):
    """A library's own name for torch's out-of-memory error."""


class CompilerFailed(Exception):
    """Stands for a compiler's wrapper around the error it met."""


def wrapped_oom() -> Exception:
    try:
        raise torch.OutOfMemoryError("allocation failed")
    except torch.OutOfMemoryError as oom:
        try:
            raise CompilerFailed("backend failed") from oom
        except CompilerFailed as exc:
            return exc


@pytest.mark.parametrize("exc", [torch.OutOfMemoryError("allocation of 2.00 GiB failed"),
                                 torch.cuda.OutOfMemoryError("no words about memory"),
                                 RenamedOOM("still no words"),
                                 RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
                                 wrapped_oom()],
                         ids=["type", "cuda-alias", "subclass", "message", "cublas", "cause"])
def test_out_of_memory_is_known_by_type_and_by_message(exc: Exception) -> None:
    assert is_out_of_memory(exc)
    assert classify(exc, "encode").reason == "encode.out_of_memory"


def test_other_errors_are_not_out_of_memory() -> None:
    assert not is_out_of_memory(ValueError("out of memory"))  # not a runtime error of torch
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    try:
        raise torch.OutOfMemoryError("allocation failed")
    except torch.OutOfMemoryError:
        handled = RuntimeError("another error raised while one was handled")
    assert not is_out_of_memory(handled)


def test_an_out_of_memory_error_by_type_halves_the_batch() -> None:
    sizes: list[int] = []

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        sizes.append(len(payloads))
        if len(payloads) > 2:
            raise torch.OutOfMemoryError("allocation failed")  # no "out of memory" in the message
        return EncodeOutput(torch.zeros(len(payloads), 2))

    runner = BatchRunner(encode, batch_size=8, grow_after=100)
    outcomes = runner.run("image", list(range(8)))
    assert all(o.error is None for o in outcomes)
    assert sizes[:3] == [8, 4, 2] and runner.stats.bisections == 0 and runner.size("image") == 2


class LostEvent:
    """A CUDA timing event on a device that fails after its passes: never done; waiting for it
    raises the sticky error."""

    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise torch.AcceleratorError(ILLEGAL)

    def elapsed_time(self, end: Any) -> float:
        return 1.0


@dataclass
class TimedEncoder(FakeEncoder):
    """The fake encoder with the real CUDA-event forward timer around each batch."""

    timer: ForwardTimer = field(default_factory=lambda: ForwardTimer("cuda:0"))

    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        with self.timer:
            return super().encode(modality, payloads)

    def device_seconds(self) -> float | None:
        return self.timer.seconds()


def test_a_sticky_error_first_seen_by_the_forward_timer_fails_the_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", LostEvent)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"text {i}"} for i in range(10)])
    out = tmp_path / "out"
    with pytest.raises(DeviceError, match="forward's CUDA-event timer") as info:
        run_encode(make_cfg([manifest], out, batch_size=4, shard_size=4), encoder_factory=factory(TimedEncoder()))
    assert info.value.exit_code == 1
    [meta] = OutDir(out).read_task_metas()
    assert meta["state"] == "failed" and "illegal memory access" in meta["error"]
    assert meta["counters"]["balanced"] and error_rows(out) == []
    text = meta["counters"]["modalities"]["text"]
    assert text["encoded"] + text["not_attempted"] == 10
    assert len(embeddings(out)) == text["encoded"]  # what was committed stays, and is counted so


class PassedLostEvent(LostEvent):
    """As `LostEvent`, but the device says it has passed it: read when the next pass starts."""

    def query(self) -> bool:
        return True


def test_a_timer_fault_met_at_a_launch_is_not_bisected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timer looks at earlier passes when the next one starts: a fault there ends the run at
    once, as a forward's own fault does, instead of being bisected as the batch's failure."""
    monkeypatch.setattr(torch.cuda, "Event", PassedLostEvent)
    timer = ForwardTimer("cuda:0")
    calls: list[int] = []

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        calls.append(len(payloads))
        with timer:
            return EncodeOutput(torch.zeros(len(payloads), 2))

    with pytest.raises(DeviceError, match="the device failed"):
        BatchRunner(encode, batch_size=4).run("image", list(range(8)))
    assert calls == [4, 4]
