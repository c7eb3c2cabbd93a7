"""mmenc's CPU forward: oneDNN linears and two batch streams give the vectors PyTorch's own path
gives (float32, max |diff| <= 1e-5), in order, and fail cleanly.

The faster path is on by default on the CPU (`--cpu-forward auto`); `plain` is PyTorch's own
forward on one stream, the reference here; `onednn` pins oneDNN's linears (with `auto` the run's
timed batches choose between them and PyTorch's, `test_choice.py`). Batches of 40 are split into
two streams of 20.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import load_encoder
from mmenc_cli.encoders.cpu import onednn, streams
from tests import modelfactory as mf

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cpu-forward")
    return {"clip": mf.make_tiny_clip(root / "clip"), "st": mf.make_tiny_st(root / "st"),
            "siglip": mf.make_tiny_siglip(root / "siglip"), "vit": mf.make_tiny_vit(root / "vit"),
            "dinov2": mf.make_tiny_dinov2(root / "dinov2")}


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


def load(path: Path, fast: bool, mode: str | None = None):
    mode = mode or ("onednn" if fast else "plain")
    return load_encoder(ModelConfig(model=str(path), device="cpu", cpu_forward=mode), device="cpu")


@pytest.mark.parametrize("name, modality", [("st", "text"), ("clip", "image"), ("siglip", "image"),
                                            ("siglip", "text"), ("vit", "image"), ("dinov2", "image")])
def test_fast_cpu_forward_equals_pytorchs_own(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                             threads: None, name: str, modality: str) -> None:
    """Packed linears and fused blocks (BERT, ViT, DINOv2 intermediates/outputs, SigLIP's tanh-GELU
    MLPs; CLIP's quick-GELU MLPs stay unfused) give PyTorch's vectors."""
    path = models[name]
    monkeypatch.setenv("MMENC_ONEDNN", "1")  # the variables of earlier versions are no longer read
    monkeypatch.setenv("MMENC_CPU_STREAMS", "2")
    ref = load(path, fast=False)
    assert ref.info["cpu_linear"] is None and ref.info["cpu_streams"] == 1
    payloads = texts(40) if modality == "text" else [ref.image_preprocessor()(im) for im in images(40)]
    want = ref.encode(modality, payloads)
    fast = load(path, fast=True)
    if torch.backends.mkldnn.is_available():
        assert fast.info["cpu_linear"] == "onednn"
        assert any(isinstance(m, torch.nn.Linear) and "forward" in vars(m) for m in fast.model.modules())
        fused = {type(m).__name__ for m in fast.model.modules()
                 if "forward" in vars(m) and not isinstance(m, torch.nn.Linear)}
        assert bool(fused) is (name != "clip"), fused  # CLIP's MLPs use quick-GELU: no post-op for it
    assert fast.info["cpu_streams"] == min(2, streams._TORCH_THREADS[0])
    if fast.info["cpu_streams"] == 2:
        assert len(fast.forward.split(payloads)) == 2 and len(fast.forward.split(payloads[:15])) == 1
    got = fast.encode(modality, payloads)
    assert got.vectors.shape == want.vectors.shape and got.vectors.dtype == torch.float32
    assert (got.vectors - want.vectors).abs().max().item() <= TOL  # in order: row i is still item i
    assert got.truncated == want.truncated
    # a lone small batch gives the same rows as inside the split batch
    part = fast.encode(modality, payloads[3:9]).vectors
    assert (part - want.vectors[3:9]).abs().max().item() <= TOL


def test_by_default_both_paths_run_and_give_pytorchs_vectors(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                           threads: None) -> None:
    """With `--cpu-forward auto` the run's batches choose the path: early batches probe oneDNN's,
    every batch is within 1e-5 of PyTorch's, and the reference path *is* PyTorch's (bitwise, on
    a batch small enough to run as one part on all threads, as `plain` runs it)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    ref = load(models["st"], fast=False)
    enc = load(models["st"], fast=True, mode="auto")
    choice = enc.forward.choice
    assert enc.info["cpu_linear"] == "auto" and onednn.cpu_path_choice(enc.model) is choice
    batches = [texts(40 + i)[i:] for i in range(16)]
    paths = []
    for batch in batches:
        got = enc.encode("text", batch).vectors
        paths.append(choice.on)
        assert (got - ref.encode("text", batch).vectors).abs().max().item() <= TOL
    assert True in paths and False in paths, paths
    timed = sum(choice.counts)
    # untimed: the load-time probe and the first batch (warm-ups); lone parts when streams are off
    assert timed == (len(batches) - 1 if enc.info["cpu_streams"] == 2 or streams._TORCH_THREADS[0] == 1 else 0)
    summary = enc.forward_summary()
    assert summary["mode"] == "auto" and summary["evidence"] and summary["linears"] in ("onednn", "pytorch")
    choice.fixed = False  # PyTorch's path through the patched layers: the same arithmetic
    small = batches[0][:10]
    assert torch.equal(enc.encode("text", small).vectors, ref.encode("text", small).vectors)


def test_a_failing_stream_fails_the_call_after_every_part_has_finished(models: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      threads: None) -> None:
    enc = load(models["st"], fast=True)
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
    monkeypatch.setattr(onednn, "_onednn_linear", lambda self, x: torch.nn.functional.linear(x, self.weight) + 1.0)
    assert onednn.use_onednn_linears(model) == 0
    assert not any("forward" in vars(m) for m in model)
    monkeypatch.undo()
    if torch.backends.mkldnn.is_available():
        x = torch.randn(5, 8)
        want = model(x)
        assert onednn.use_onednn_linears(model, pinned=True) == 2
        assert onednn.cpu_path_choice(model).fixed is True
        assert torch.allclose(model(x), want, rtol=0, atol=1e-6)


def test_bert_blocks_get_fused_gelu_and_residual_adds(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                       threads: None) -> None:
    """On the tiny BERT every intermediate gets the GELU and every output block the residual add
    as a oneDNN post-op, on packed weights (the equality with PyTorch's path is checked above)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    enc = load(models["st"], fast=True)
    layers = enc.model.encoder.layer
    for layer in layers:
        for block in (layer.intermediate, layer.output, layer.attention.output):
            assert "forward" in vars(block), type(block).__name__
    linears = [m for m in enc.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("_mmenc_w" in vars(m) for m in linears)
    assert not any(name.endswith("_mmenc_w") for name, _ in enc.model.named_parameters())


class _Intermediate(torch.nn.Module):
    def __init__(self, act: torch.nn.Module) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(8, 16)
        self.intermediate_act_fn = act

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.intermediate_act_fn(self.dense(hidden_states))


class _Output(torch.nn.Module):
    def __init__(self, norm: bool, scale: float = 1.0) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(16, 8)
        self.LayerNorm = torch.nn.LayerNorm(8) if norm else None
        self.scale = scale

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        out = self.dense(hidden_states) + self.scale * input_tensor
        return self.LayerNorm(out) if self.LayerNorm is not None else out


@pytest.mark.parametrize("block, fused", [
    (_Intermediate(torch.nn.GELU()), True),                       # exact GELU: the "none" post-op
    (_Intermediate(torch.nn.GELU(approximate="tanh")), True),     # tanh GELU: the "tanh" post-op
    (_Intermediate(torch.nn.ReLU()), False),                      # no GELU: left alone
    (_Intermediate(torch.nn.SiLU()), False),
    (_Output(norm=True), True),                                   # LayerNorm(dense(x) + residual)
    (_Output(norm=False), True),                                  # dense(x) + residual
    (_Output(norm=True, scale=0.5), False),                       # a scaled residual is not a plain add
])
def test_a_block_is_fused_only_when_it_computes_what_it_did(block: torch.nn.Module, fused: bool) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    model = torch.nn.ModuleList([block]).eval()
    args = (torch.randn(4, 5, 8),) if isinstance(block, _Intermediate) else (torch.randn(4, 5, 16), torch.randn(4, 5, 8))
    with torch.inference_mode():
        want = block(*args)
        assert onednn.use_onednn_linears(model) == 1
        got = block(*args)
    assert ("forward" in vars(block)) is fused
    assert (got - want).abs().max().item() <= TOL


def test_freed_memory_is_kept_unless_the_user_tunes_malloc() -> None:
    """`keep_freed_memory` sets glibc's thresholds once per process, and stays out of the way of a
    user's own malloc tuning or MMENC_MALLOC=0 (each case in a fresh interpreter)."""
    import os
    import subprocess
    import sys

    code = "from mmenc_cli.encoders.cpu.malloc import keep_freed_memory as k; print(k(), k())"
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}

    def run(**env: str) -> str:
        return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                              text=True, check=True).stdout.split()

    import platform

    expected = "True" if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc" else "False"
    assert run() == [expected, expected]
    assert run(MMENC_MALLOC="0") == ["False", "False"]
    assert run(MALLOC_ARENA_MAX="2") == ["False", "False"]
    assert run(GLIBC_TUNABLES="glibc.malloc.trim_threshold=0") == ["False", "False"]


def test_a_run_records_its_cpu_forward_and_logs_it_only_at_debug(models: dict[str, Path], tmp_path: Path,
                                                                 threads: None, caplog: pytest.LogCaptureFixture) -> None:
    """The task metadata records how the CPU forward ran (the mode asked, streams, linears, the
    probes' evidence), which the benchmarks read; the path's diagnostics are DEBUG lines only."""
    import json
    import logging

    from mmenc_cli.config import BatchConfig, RunConfig, WriterConfig
    from mmenc_cli.run.pipeline import run_encode

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts(200))))
    for mode in ("auto", "plain"):
        cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(models["st"]), device="cpu",
                                                                     cpu_forward=mode),
                        writer=WriterConfig(out=str(tmp_path / mode)), batch=BatchConfig(batch_size=16),
                        modalities=("text",))
        with caplog.at_level(logging.DEBUG, logger="mmenc"):
            caplog.clear()
            result = run_encode(cfg)
        assert result.counters.encoded == 200
        meta = json.loads((tmp_path / mode / "_mmenc" / "tasks" / "task-00000.json").read_text())
        assert meta["forward"] == result.forward and meta["config"]["model"]["cpu_forward"] == mode
        cpu_lines = [r for r in caplog.records if r.getMessage().startswith("CPU forward")]
        assert all(r.levelno == logging.DEBUG for r in cpu_lines)
        if mode == "plain":
            assert result.forward == {"mode": "plain", "streams": 1, "linears": "pytorch", "evidence": None}
            assert not cpu_lines
        else:
            assert result.forward["mode"] == "auto" and result.forward["streams"] == min(2, streams._TORCH_THREADS[0])
            assert "probes" in result.forward["evidence"] and cpu_lines
