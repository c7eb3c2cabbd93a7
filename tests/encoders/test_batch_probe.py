"""The default batch size on CUDA: a short probe of forwards at load, on the fake CUDA layer.

The probe takes the largest of a few sizes whose forward fits (no out-of-memory error, a peak
within its share of the device's memory) and does not lose throughput; the run records what it
chose in the task metadata, not in the fingerprint; an explicit `--batch-size` is kept and skips
the probe; the CPU keeps 32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import pytest
import torch

from mmenc_cli.config import DEFAULT_BATCH_SIZE, BatchConfig, ModelConfig
from mmenc_cli.encoders import batch_probe, load_encoder
from mmenc_cli.encoders.base import EncodeOutput
from mmenc_cli.encoders.batch_probe import MEMORY_SHARE, SIZES, Device, probe_batch_size
from mmenc_cli.errors import DeviceError
from mmenc_cli.output import OutDir
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg

MIB = 2**20


class FakeGPU:
    """A device whose forward costs `overhead` s per call plus `per_item` s per item, whose peak
    memory is `item_bytes` per item of the last forward, and which runs out of memory above `fits`
    items (`torch.OutOfMemoryError`, as torch raises it)."""

    def __init__(self, overhead: float = 0.004, per_item: float = 0.0001, item_bytes: int = MIB,
                 total: int = 10**6 * MIB, fits: int = 10**9, fault_at: int | None = None) -> None:
        self.clock, self.overhead, self.per_item, self.item_bytes = 0.0, overhead, per_item, item_bytes
        self.total, self.fits, self.fault_at, self.last, self.resets = total, fits, fault_at, 0, 0

    def run(self, n: int) -> None:
        if self.fault_at is not None and n >= self.fault_at:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        if n > self.fits:
            raise torch.OutOfMemoryError(f"Tried to allocate {n} MiB")
        self.clock += self.overhead + self.per_item * n
        self.last = n

    def device(self) -> Device:
        return Device(sync=lambda: None, reset_peak=self.reset, peak=lambda: self.last * self.item_bytes,
                      total=self.total, free_cache=lambda: None)

    def reset(self) -> None:
        self.resets += 1


def probe(gpu: FakeGPU) -> Any:
    return probe_batch_size(gpu.run, gpu.device(), clock=lambda: gpu.clock)


def test_the_largest_size_that_fits_and_keeps_throughput() -> None:
    gpu = FakeGPU()
    result = probe(gpu)
    assert result.chosen == SIZES[-1] and [e["size"] for e in result.tried] == list(SIZES)
    rates = [e["items_per_s"] for e in result.tried]
    assert rates == sorted(rates) and gpu.resets == len(SIZES) + 1  # the run's own peak is reset after


def test_out_of_memory_stops_the_probe() -> None:
    result = probe(FakeGPU(fits=200))
    assert result.chosen == 128 and result.tried[-1] == {"size": 256, "stopped": "out of memory"}


def test_a_peak_over_the_memory_share_is_not_chosen() -> None:
    result = probe(FakeGPU(total=int(200 * MIB / MEMORY_SHARE)))  # 256 items peak at 256 MiB: over
    assert result.chosen == 128 and "peak over" in result.tried[-1]["stopped"]


def test_a_size_that_loses_throughput_is_not_chosen() -> None:
    """Past 128 the device is saturated and slows down per item (e.g. attention memory traffic)."""
    gpu = FakeGPU()
    real = gpu.run

    def slower(n: int) -> None:
        real(n)
        gpu.clock += 0.0 if n <= 128 else 0.001 * n

    gpu.run = slower  # type: ignore[method-assign]
    result = probe(gpu)
    assert result.chosen == 128 and "rate" in result.tried[-1]["stopped"]


def test_nothing_fits_keeps_the_smallest_size() -> None:
    assert probe(FakeGPU(fits=8)).chosen == SIZES[0]


def test_a_sticky_error_while_probing_is_the_device_s() -> None:
    with pytest.raises(DeviceError, match="while probing batch sizes"):
        probe(FakeGPU(fault_at=64))


def test_a_clip_on_the_fake_cuda_layer_probes_its_image_forward(tiny_clip: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny CLIP's own image forward, with torch.cuda's synchronize, memory statistics and
    device properties faked (tensors stay on the CPU): 1 MiB a pixel batch item and 300 MiB of
    device memory put the limit at 128; the peak statistics are reset after the probe."""
    encoder = load_encoder(ModelConfig(model=str(tiny_clip), device="cpu"))
    gpu = FakeGPU()
    batches: list[int] = []

    def stack(arrays: Sequence[np.ndarray], device: str) -> torch.Tensor:
        batches.append(len(arrays))
        gpu.run(len(arrays))
        return torch.from_numpy(np.stack(arrays))

    monkeypatch.setattr("mmenc_cli.encoders.torch_encoder.stack_to_device", stack)
    monkeypatch.setattr(batch_probe.time, "perf_counter", lambda: gpu.clock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: gpu.reset())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: gpu.last * MIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=int(200 * MIB / MEMORY_SHARE)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert encoder.default_batch_size(("image",)) is None  # on the CPU: no probe, no choice
    encoder.device = "cuda:0"
    assert encoder.default_batch_size(("image",)) == 128
    assert set(batches) == {32, 64, 128, 256} and gpu.resets == 5  # one per size tried, one after
    summary = encoder.forward_summary()
    assert summary["batch_probe"]["image"]["chosen"] == 128


@dataclass
class ProbingEncoder(FakeEncoder):
    """The fake encoder on a "CUDA device" whose probe chooses `choice`."""

    choice: int = 16
    probed: list[tuple[str, ...]] = field(default_factory=list)

    def default_batch_size(self, modalities: Sequence[str]) -> int | None:
        self.probed.append(tuple(modalities))
        return self.choice


def texts(tmp_path: Path, n: int = 40) -> Path:
    return write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"text {i}"} for i in range(n)])


def test_without_batch_size_the_run_uses_and_records_the_choice(tmp_path: Path) -> None:
    encoder = ProbingEncoder()
    cfg = make_cfg([texts(tmp_path)], tmp_path / "out", batch_size=None, shard_size=100)
    result = run_encode(cfg, encoder_factory=factory(encoder))
    assert result.batch_size == 16 and encoder.probed == [("image", "text")]  # what the run encodes
    assert {n for _, n in encoder.batches} == {16, 8}  # 40 texts: 16, 16, 8
    [meta] = OutDir(tmp_path / "out").read_task_metas()
    assert meta["batch_size"] == 16 and meta["config"]["batch"]["batch_size"] is None
    run_json = json.loads((tmp_path / "out" / "_mmenc" / "run.json").read_text())
    assert "batch_size" not in json.dumps(run_json["fingerprint"])
    again = run_encode(make_cfg([texts(tmp_path, 44)], tmp_path / "out", batch_size=7, shard_size=100),
                       encoder_factory=factory(ProbingEncoder(choice=64)))  # another size resumes the output
    assert again.state == "done" and again.batch_size == 7


def test_an_explicit_batch_size_is_kept_and_skips_the_probe(tmp_path: Path) -> None:
    encoder = ProbingEncoder()
    result = run_encode(make_cfg([texts(tmp_path)], tmp_path / "out", batch_size=8),
                        encoder_factory=factory(encoder))
    assert result.batch_size == 8 and encoder.probed == [] and {n for _, n in encoder.batches} == {8}
    assert OutDir(tmp_path / "out").read_task_metas()[0]["batch_size"] == 8


def test_the_cpu_default_stays_32(tmp_path: Path) -> None:
    assert BatchConfig().batch_size is None and BatchConfig().size_for(None) == DEFAULT_BATCH_SIZE == 32
    assert BatchConfig(batch_size=5).size_for(256) == 5 and BatchConfig().size_for(256) == 256
    result = run_encode(make_cfg([texts(tmp_path, 70)], tmp_path / "out", batch_size=None),
                        encoder_factory=factory(FakeEncoder()))
    assert result.batch_size == 32
