"""mmenc's CPU forward: oneDNN linears and two batch streams give the vectors PyTorch's own path
gives (float32, max |diff| <= 1e-5), in order, and fail cleanly.

The faster path is on by default on the CPU; `MMENC_ONEDNN=0` and `MMENC_CPU_STREAMS=1` turn its
two parts off, which is the reference here. Batches of 40 are split into two streams of 20.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import load_encoder
from mmenc_cli.encoders import hf
from tests import modelfactory as mf

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpu-forward")
    return {"clip": mf.make_tiny_clip(root / "clip"), "st": mf.make_tiny_st(root / "st")}


@pytest.fixture
def threads():
    """Each encoder load sets torch's thread share: put torch's own count back afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def texts(n: int) -> list[str]:
    words = ["the", "red", "car", "is", "on", "a", "blue", "dog", "and", "cat"]
    return [" ".join(words[(i + j) % len(words)] for j in range(1 + (i * 7) % 23)) for i in range(n)]


def images(n: int) -> list[Image.Image]:
    rng = np.random.RandomState(3)
    return [Image.fromarray(rng.randint(0, 256, (20 + i % 17, 30 + (i * 5) % 29, 3), dtype=np.uint8)) for i in range(n)]


def load(path: Path, monkeypatch: pytest.MonkeyPatch, fast: bool):
    monkeypatch.setenv("MMENC_ONEDNN", "1" if fast else "0")
    monkeypatch.setenv("MMENC_CPU_STREAMS", "2" if fast else "1")
    return load_encoder(ModelConfig(model=str(path), device="cpu"), device="cpu")


@pytest.mark.parametrize("modality", ["text", "image"])
def test_fast_cpu_forward_equals_pytorchs_own(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                             threads: None, modality: str) -> None:
    path = models["st" if modality == "text" else "clip"]
    ref = load(path, monkeypatch, fast=False)
    assert ref.info["cpu_linear"] is None and ref.info["cpu_streams"] == 1
    payloads = texts(40) if modality == "text" else [ref.image_preprocessor()(im) for im in images(40)]
    want = ref.encode(modality, payloads)
    fast = load(path, monkeypatch, fast=True)
    if torch.backends.mkldnn.is_available():
        assert fast.info["cpu_linear"] == "onednn"
        assert any(isinstance(m, torch.nn.Linear) and "forward" in vars(m) for m in fast.model.modules())
    assert fast.info["cpu_streams"] == min(2, hf._TORCH_THREADS[0])
    if fast.info["cpu_streams"] == 2:
        assert len(fast._split(payloads)) == 2 and len(fast._split(payloads[:15])) == 1
    got = fast.encode(modality, payloads)
    assert got.vectors.shape == want.vectors.shape and got.vectors.dtype == torch.float32
    assert (got.vectors - want.vectors).abs().max().item() <= TOL  # in order: row i is still item i
    assert got.truncated == want.truncated
    # a lone small batch gives the same rows as inside the split batch
    part = fast.encode(modality, payloads[3:9]).vectors
    assert (part - want.vectors[3:9]).abs().max().item() <= TOL


def test_a_failing_stream_fails_the_call_after_every_part_has_finished(models: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      threads: None) -> None:
    enc = load(models["st"], monkeypatch, fast=True)
    if enc.info["cpu_streams"] < 2:
        pytest.skip("one CPU thread: no second stream")
    calls: list[int] = []
    real = enc._run["text"]

    def flaky(inputs):
        calls.append(int(inputs["input_ids"].shape[0]))
        if len(calls) == 2:
            raise RuntimeError("injected stream failure")
        return real(inputs)

    enc._run["text"] = flaky
    with pytest.raises(RuntimeError, match="injected stream failure"):
        enc.encode("text", texts(32))
    assert sorted(calls) == [16, 16]
    enc._run["text"] = real
    assert enc.encode("text", texts(32)).vectors.shape[0] == 32  # the encoder still works


def test_onednn_is_refused_when_it_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time probe compares oneDNN with F.linear and keeps PyTorch's path on a mismatch."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    monkeypatch.setattr(hf, "_onednn_linear", lambda self, x: torch.nn.functional.linear(x, self.weight) + 1.0)
    assert hf.use_onednn_linears(model) == 0
    assert not any("forward" in vars(m) for m in model)
    monkeypatch.undo()
    monkeypatch.setenv("MMENC_ONEDNN", "0")
    assert hf.use_onednn_linears(model) == 0
    monkeypatch.setenv("MMENC_ONEDNN", "1")
    if torch.backends.mkldnn.is_available():
        x = torch.randn(5, 8)
        want = model(x)
        assert hf.use_onednn_linears(model) == 2
        assert torch.allclose(model(x), want, rtol=0, atol=1e-6)
