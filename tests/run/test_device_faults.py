"""What a GPU does that a CPU run never shows, proven without a GPU through a fake device layer.

* the failed batch's activations are freed before an out-of-memory retry (a weak reference);
* a batch size that keeps running out of memory is grown back into ever more rarely;
* a sticky CUDA error (illegal address, device assert) ends the run with exit 1, every item
  accounted for, instead of failing items one by one through the whole manifest;
* each device process makes its own GPU the current device before the model loads;
* `--compile` compiles once for all batch sizes and text lengths, and that time is not forward time;
* image batches reach the device through one copy into pinned memory.
"""

from __future__ import annotations

import functools
import gc
import math
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest
import torch

from mmenc_cli.batching import BatchRunner
from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import _load
from mmenc_cli.encoders.base import EncodeOutput
from mmenc_cli.encoders.forward import CompiledOrEager, PlainForward
from mmenc_cli.errors import DeviceError, is_device_fault
from mmenc_cli.output import OutDir
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import make_image, write_jsonl
from tests.fakes import FakeEncoder, FakeOOM, factory, fake_cuda_streams
from tests.runs import embeddings, error_rows, make_cfg

ILLEGAL = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be reported asynchronously"


class Activations:
    """Stands for the tensors a forward allocates."""


def test_failed_batch_is_freed_before_the_retry() -> None:
    alive_at_retry: list[bool] = []
    last: list[weakref.ref] = []

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        if last:
            gc.disable()  # only reference counting may free it, as CUDA memory must be at once
            alive_at_retry.append(last[-1]() is not None)
            gc.enable()
        acts = Activations()
        last.append(weakref.ref(acts))
        if len(payloads) > 2:
            raise FakeOOM(len(payloads))
        return EncodeOutput(torch.zeros(len(payloads), 2))

    outcomes = BatchRunner(encode, batch_size=8, grow_after=100).run("image", list(range(8)))
    assert all(o.error is None for o in outcomes)
    assert alive_at_retry and not any(alive_at_retry)


def test_a_size_that_cannot_fit_is_retried_ever_more_rarely() -> None:
    """Fixed-shape inputs: batches above 4 never fit. Growing back every `grow_after` batches
    would run out of memory 1 in 3 batches; the back-off doubles the wait each time."""
    sizes: list[int] = []

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        sizes.append(len(payloads))
        if len(payloads) > 4:
            raise FakeOOM(len(payloads))
        return EncodeOutput(torch.zeros(len(payloads), 2))

    runner = BatchRunner(encode, batch_size=8, grow_after=2)
    outcomes = runner.run("image", list(range(4000)))  # 1000 batches of 4
    assert all(o.error is None for o in outcomes)
    assert runner.stats.oom_halvings <= 2 + math.ceil(math.log2(1000 / 2))
    assert runner.size("image") == 4 or sizes[-1] == 8


def test_texts_out_of_memory_do_not_shrink_images() -> None:
    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        if modality == "text" and len(payloads) > 2:
            raise FakeOOM(len(payloads))
        return EncodeOutput(torch.zeros(len(payloads), 2))

    runner = BatchRunner(encode, batch_size=8, grow_after=100)
    runner.run("text", list(range(8)))
    runner.run("image", list(range(8)))
    assert (runner.size("text"), runner.size("image")) == (2, 8)


@pytest.mark.parametrize("message", [ILLEGAL, "CUDA error: device-side assert triggered",
                                     "CUDA error: misaligned address"])
def test_sticky_device_error_is_not_bisected(message: str) -> None:
    calls: list[int] = []

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        calls.append(len(payloads))
        raise torch.AcceleratorError(message)

    with pytest.raises(DeviceError, match="the device failed"):
        BatchRunner(encode, batch_size=8).run("image", list(range(8)))
    assert calls == [8]


def test_device_fault_classification() -> None:
    assert is_device_fault(RuntimeError(ILLEGAL))
    assert not is_device_fault(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_device_fault(ValueError("illegal memory access"))  # not a runtime error of torch
    assert not is_device_fault(RuntimeError("shape mismatch: illegal instruction in the manifest"))


@dataclass
class DyingDevice(FakeEncoder):
    """Works for `good_batches` batches, then every call fails as a lost CUDA context does."""

    good_batches: int = 2

    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        if len(self.batches) >= self.good_batches:
            self.batches.append((modality, len(payloads)))
            raise RuntimeError(ILLEGAL)
        return super().encode(modality, payloads)


def test_sticky_device_error_ends_the_run_and_a_rerun_finishes_it(tmp_path: Path) -> None:
    rows = [{"id": f"t{i}", "text": f"text number {i}"} for i in range(40)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    out = tmp_path / "out"
    dying = DyingDevice()
    with pytest.raises(DeviceError) as info:
        run_encode(make_cfg([manifest], out, batch_size=4, shard_size=4), encoder_factory=factory(dying))
    assert info.value.exit_code == 1
    assert len(dying.batches) == 3  # two good batches, one failure: no bisection through the manifest
    assert error_rows(out) == []  # no item is blamed for the device
    [meta] = OutDir(out).read_task_metas()
    assert meta["state"] == "failed" and "the device failed" in meta["error"] and meta["counters"]["balanced"]
    text = meta["counters"]["modalities"]["text"]
    assert text["requested"] == 40 and text["failed"] == {}
    assert text["encoded"] + text["not_attempted"] == 40 and text["not_attempted"] > 0

    result = run_encode(make_cfg([manifest], out, batch_size=4, shard_size=4), encoder_factory=factory(FakeEncoder()))
    assert result.state == "done" and result.counters.balanced
    assert sorted(i for i, _ in embeddings(out)) == sorted(f"t{i}" for i in range(40))


def test_cuda_exit_code_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from mmenc_cli.cli.app import app
    from mmenc_cli.run import pipeline

    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"t {i}"} for i in range(8)])
    real = pipeline.EncodeRun.__init__

    def with_dying_device(self: Any, cfg: Any, **kw: Any) -> None:
        real(self, cfg, **{**kw, "encoder_factory": factory(DyingDevice(good_batches=0))})

    monkeypatch.setattr(pipeline.EncodeRun, "__init__", with_dying_device)
    res = CliRunner().invoke(app, ["encode", str(manifest), "--out", str(tmp_path / "out"), "--model", "fake",
                                   "--device", "cpu", "--progress", "none"])
    assert res.exit_code == 1, res.output
    assert "the device failed" in res.output


def test_each_device_process_sets_its_own_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--device cuda:0,cuda:1`: the process of cuda:1 makes it the current device before the
    model loads, so its CUDA events, streams and context are not on GPU 0."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d).index))
    seen: list[tuple[str, list[int]]] = []

    def loader(what: Any, cfg: ModelConfig, device: str) -> str:
        seen.append((device, list(calls)))
        return device

    monkeypatch.setattr("tests.run.test_device_faults.fake_loader", loader, raising=False)
    assert _load("tests.run.test_device_faults:fake_loader", frozenset({"mean"}), "fake",
                 ModelConfig(model="fake", device="cuda:0,cuda:1", pooling="mean"), "cuda:1", None) == "cuda:1"
    assert seen == [("cuda:1", [1])]
    calls.clear()
    _load("tests.run.test_device_faults:fake_loader", frozenset({"mean"}), "fake",
          ModelConfig(model="fake", device="cpu", pooling="mean"), "cpu", None)
    assert calls == []


def test_compile_once_for_every_batch_size_and_length(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    lin = torch.nn.Linear(4, 3)

    def fn(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return lin(inputs["x"]) + inputs["ids"].float().sum(1, keepdim=True)

    compiled = CompiledOrEager(fn, "test")
    forward = PlainForward("cpu", "plain")
    forward.timer = timer = PassTimer()
    flags = []
    for n, length in [(3, 5), (5, 7), (8, 2), (2, 9)]:
        inputs = {"x": torch.randn(n, 4), "ids": torch.ones(n, length, dtype=torch.long)}
        out, _ = forward.run(list(range(n)), lambda p, inputs=inputs: (inputs, []), compiled)
        np.testing.assert_allclose(out.numpy(), fn(inputs).detach().numpy(), rtol=1e-6)
        flags.append(compiled.compiled_now)
    assert flags == [True, False, False, False]
    assert counters["stats"]["unique_graphs"] == 1
    assert forward.summary()["compile_seconds"] > 0
    assert timer.passes == 3  # the pass that compiled is not the model's device time


class PassTimer:
    """Stands for the CUDA-event timer: counts the passes it times."""

    passes = 0

    def __enter__(self) -> None:
        self.passes += 1

    def __exit__(self, *exc: Any) -> None:
        pass

    def discard_last(self) -> None:
        self.passes -= 1


def test_cuda_batches_are_stacked_into_pinned_memory_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pixels (views of the workers' shared memory) go to the device through one copy into
    pinned host memory and an asynchronous copy on a copy stream, not stack + pin + copy."""
    from mmenc_cli.encoders.device import stack_to_device

    arrays = [np.full((3, 4, 5), i, dtype=np.uint8) for i in range(6)]
    np.testing.assert_array_equal(stack_to_device(arrays, "cpu").numpy(), np.stack(arrays))
    real_empty, pinned, moved = torch.empty, [], []

    def empty(*a: Any, **k: Any) -> torch.Tensor:
        pinned.append(k.pop("pin_memory", False))
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", empty)
    log: list[str] = []
    fake_cuda_streams(monkeypatch, log)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: moved.append((a, k)) or log.append("copy") or self)
    host = stack_to_device(arrays, "cuda:1")
    assert pinned == [True] and moved == [(("cuda:1",), {"non_blocking": True})]
    assert host.dtype == torch.uint8
    np.testing.assert_array_equal(host.numpy(), np.stack(arrays))
    # the copy runs on a copy stream (overlapping the previous forward); the forward's stream waits
    assert log == ["on side", "copy", "off side", "current waits for side", "used on current"]


class FakeCudaTensor:
    """Stands for a CUDA tensor: records its copy to the host."""

    is_cuda = True

    def __init__(self, value: torch.Tensor, log: list[str]) -> None:
        self.value, self.log = value, log

    def __len__(self) -> int:
        return len(self.value)

    def detach(self) -> "FakeCudaTensor":
        return self

    def to(self, device: str, non_blocking: bool = False) -> torch.Tensor:
        self.log.append(f"copy to {device} non_blocking={non_blocking}")
        return self.value


class FakeEvent:
    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def record(self) -> None:
        self.log.append("event recorded")

    def synchronize(self) -> None:
        self.log.append("waited")
        if self.fail:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


def test_vectors_come_back_without_blocking_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the launch starts a non-blocking copy to the host and records an event; only
    `outcomes()` waits, and an asynchronous device error found there ends the run."""
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        log.append(f"forward {len(payloads)}")
        return EncodeOutput(FakeCudaTensor(torch.arange(len(payloads) * 2, dtype=torch.float32).view(-1, 2), log))

    launched = BatchRunner(encode, batch_size=2).launch("image", [1, 2, 3])
    assert log == ["forward 2", "copy to cpu non_blocking=True", "event recorded",
                   "forward 1", "copy to cpu non_blocking=True", "event recorded"]
    outcomes = launched.outcomes()
    assert log[-2:] == ["waited", "waited"]
    assert [o.value.tolist() for o in outcomes] == [[0.0, 1.0], [2.0, 3.0], [0.0, 1.0]]

    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log, fail=True))
    with pytest.raises(DeviceError, match="the device failed"):
        BatchRunner(encode, batch_size=2).launch("image", [1]).outcomes()


def test_a_group_is_accounted_while_the_next_one_runs(tmp_path: Path) -> None:
    """The stage launches group N + 1 before it waits for and writes group N."""
    events: list[str] = []

    @dataclass
    class Logging(FakeEncoder):
        def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
            events.append(f"launch {len(self.batches) + 1}")
            return super().encode(modality, payloads)

    rows = [{"id": f"i{i}", "image": make_image(tmp_path / f"{i}.png", (8 + i, 8), seed=i).name} for i in range(12)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    result = run_encode(make_cfg([manifest], tmp_path / "out", batch_size=4), encoder_factory=factory(Logging()),
                        progress=lambda c: events.append(f"accounted {c.mod('image').encoded}"))
    assert result.counters.mod("image").encoded == 12 and result.counters.balanced
    assert [e for e in events if e.startswith("launch")] == ["launch 1", "launch 2", "launch 3"]
    assert events.index("launch 2") < events.index("accounted 4") < events.index("launch 3")
    assert events.index("launch 3") < events.index("accounted 8")


@pytest.mark.parametrize("major, dtype", [(9, torch.bfloat16), (7, torch.float16)])
def test_auto_dtype_asks_the_device_itself(monkeypatch: pytest.MonkeyPatch, major: int, dtype: torch.dtype) -> None:
    """`--dtype auto` on cuda:1 reads cuda:1's capability, and creates nothing on the current device."""
    from types import SimpleNamespace

    from mmenc_cli.encoders.device import resolve_dtype

    asked: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: asked.append(torch.device(d).index) or SimpleNamespace(major=major))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: pytest.fail("creates a tensor on GPU 0"))
    assert resolve_dtype("auto", "cuda:1") == dtype and asked == [1]


class TimedEvent:
    """Stands for a CUDA timing event: already passed (query() is True at once)."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = TimedEvent.clock

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "TimedEvent") -> float:
        return (end.at - self.at) * 1000.0


def test_the_pass_that_compiled_is_the_one_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when the compiling pass has already finished on the device by the time it ends, it is
    that pass, and only it, that leaves the forward's device time."""
    from mmenc_cli.encoders.forward import ForwardTimer

    monkeypatch.setattr(torch.cuda, "Event", TimedEvent)
    timer = ForwardTimer("cuda:0")
    for seconds, compiled in ((1.0, False), (5.0, True), (3.0, False)):
        with timer:
            TimedEvent.clock += seconds
        if compiled:
            timer.discard_last()
    assert timer.seconds() == pytest.approx(4.0)


def test_out_of_memory_under_compile_is_the_batch_s_not_the_compiler_s(monkeypatch: pytest.MonkeyPatch) -> None:
    def compiled_oom(fn: Any, **kw: Any) -> Any:
        def run(inputs: Any) -> Any:
            raise FakeOOM(len(inputs["x"]))
        return run

    monkeypatch.setattr(torch, "compile", compiled_oom)
    eager: list[int] = []
    wrapped = CompiledOrEager(lambda inputs: eager.append(1) or inputs["x"], "test")
    with pytest.raises(FakeOOM):
        wrapped({"x": torch.zeros(4, 2)})
    assert eager == [] and wrapped.compiled is not None  # no eager retry, compilation kept
