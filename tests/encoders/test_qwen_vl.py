"""The Qwen2-VL / Qwen2.5-VL adapter against the tiny models' own reference calls.

Reference = the full `...ForConditionalGeneration.from_pretrained` model's `get_image_features`
through the model folder's own image processor, one image at a time.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import ModelLoadError, load_encoder
from mmenc_cli.errors import MMError
from tests import modelfactory_vl as mf

SIZES = [(40, 30), (90, 60), (50, 100), (200, 120), (17, 300), (300, 300), (28, 28), (3, 5)]


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mf.make_tiny_qwen2vl(tmp_path_factory.mktemp("vl") / "qwen2vl")


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mf.make_tiny_qwen25vl(tmp_path_factory.mktemp("vl") / "qwen25vl")


def images(sizes: list[tuple[int, int]] = SIZES) -> list[Image.Image]:
    rng = np.random.default_rng(7)
    out = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    rgba = Image.fromarray(rng.integers(0, 255, (45, 70, 4), dtype=np.uint8), "RGBA")  # transparency -> white
    gray = Image.fromarray(rng.integers(0, 255, (64, 33), dtype=np.uint8), "L")
    return out + [rgba, gray]


def load(model: Path, pooling: str = "tokens", dtype: str = "float32") -> Any:
    return load_encoder(ModelConfig(model=str(model), pooling=pooling, device="cpu", dtype=dtype))


def test_worker_patches_reproduce_the_processor_bit_for_bit(qwen2vl: Path) -> None:
    from transformers import AutoImageProcessor

    enc = load(qwen2vl)
    assert enc.info["image_input"] == "uint8-patches"
    imgs = images()
    payloads = [enc.image_preprocessor()(im) for im in imgs]
    assert all(p.pixels.dtype == np.uint8 for p in payloads)
    pixel_values, grid = enc._prepare(payloads)
    ref = AutoImageProcessor.from_pretrained(qwen2vl, backend="pil")(images=imgs, return_tensors="pt")
    import torch

    assert torch.equal(grid, ref["image_grid_thw"])
    assert torch.equal(pixel_values, ref["pixel_values"])  # tolerance: exact (0.0)
    for p, im, g in zip(payloads, imgs, ref["image_grid_thw"].tolist()):
        t, h, w = g
        assert p.meta == {"image_grid_thw": (t, h, w), "tokens": t * h * w // 4, "orig_size": im.size,
                          "min_pixels": mf.MIN_PIXELS, "max_pixels": mf.MAX_PIXELS}


def test_worker_preprocessing_is_torch_free(qwen2vl: Path, tmp_path: Path) -> None:
    prep = load(qwen2vl).image_preprocessor()
    (tmp_path / "prep.pkl").write_bytes(pickle.dumps(prep))
    code = ("import pickle, sys; from PIL import Image; p = pickle.load(open(sys.argv[1], 'rb')); "
            "x = p(Image.new('RGB', (90, 61))); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'; "
            "print(x.pixels.shape, x.meta['tokens'])")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "prep.pkl")], capture_output=True, text=True,
                         cwd=Path(__file__).parents[2])
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == "6"


@pytest.mark.parametrize("which", ["qwen2vl", "qwen25vl"])
def test_tokens_equal_the_models_own_get_image_features(which: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(which)
    enc = load(model)
    assert enc.output_kind == "tokens" and enc.modalities == frozenset({"image", "video"}) and enc.dim == mf.HIDDEN
    imgs = images()
    out = enc.encode("image", [enc.image_preprocessor()(im) for im in imgs]).vectors  # one batch
    ref = mf.reference_image_features(model, imgs)
    assert len(out) == len(ref)
    for got, (want, grid) in zip(out, ref):
        assert got.shape == (grid[0] * grid[1] * grid[2] // 4, mf.HIDDEN)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)


def test_only_vision_tower_tensors_are_read(qwen2vl: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors

    read: list[str] = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a: Any, **k: Any) -> None:
            self.fh = real(*a, **k)

        def __enter__(self) -> "Spy":
            self.fh.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.fh.__exit__(*exc)

        def keys(self) -> Any:
            return self.fh.keys()

        def get_tensor(self, key: str) -> Any:
            read.append(key)
            return self.fh.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    enc = load(qwen2vl)
    assert read and all(k.startswith("visual.") for k in read)
    assert enc.info["weights"]["prefix"] == "visual."


def test_transformers4_layout_sharded_checkpoint_loads(qwen2vl: Path, tmp_path: Path) -> None:
    """`model.visual.*` keys (transformers 4.5x saves), split over shards with an index."""
    import shutil

    from safetensors.numpy import load_file, save_file

    legacy = tmp_path / "legacy"
    shutil.copytree(qwen2vl, legacy)
    tensors = load_file(legacy / "model.safetensors")
    (legacy / "model.safetensors").unlink()
    renamed = {("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
                if k.startswith("model.") else k): v for k, v in tensors.items()}
    keys = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for name, part in shards.items():
        save_file({k: renamed[k] for k in part}, legacy / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (legacy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    enc = load(legacy)
    assert enc.info["weights"] == {"prefix": "model.visual.", "tensors": 31, "files": 2}
    imgs = images([(90, 60), (200, 120)])
    ref = load(qwen2vl).encode("image", [enc.image_preprocessor()(im) for im in imgs]).vectors
    got = enc.encode("image", [enc.image_preprocessor()(im) for im in imgs]).vectors
    for a, b in zip(got, ref):
        assert np.array_equal(a.numpy(), b.numpy())


def test_processor_only_folder_without_tokenizer_encodes_images(tmp_path: Path) -> None:
    model = mf.make_tiny_qwen2vl(tmp_path / "no-tok", with_tokenizer=False)
    assert not any(p.name.startswith(("tokenizer", "vocab", "merges")) for p in model.iterdir())
    enc = load(model)
    assert enc.modalities == frozenset({"image", "video"})
    assert enc.encode("image", [enc.image_preprocessor()(images()[0])]).vectors[0].shape == (6, mf.HIDDEN)


def test_mean_pooling_is_the_mean_of_the_tokens(qwen25vl: Path) -> None:
    tokens, pooled = load(qwen25vl), load(qwen25vl, pooling="mean")
    assert pooled.output_kind == "pooled" and pooled.dim == tokens.dim
    imgs = images()
    payloads = [tokens.image_preprocessor()(im) for im in imgs]
    vecs = pooled.encode("image", payloads).vectors
    assert vecs.shape == (len(imgs), mf.HIDDEN)
    for v, t in zip(vecs, tokens.encode("image", payloads).vectors):
        np.testing.assert_allclose(v.numpy(), t.mean(dim=0).numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("pooling", ["auto", "cls"])
def test_other_poolings_are_startup_errors(qwen2vl: Path, pooling: str) -> None:
    with pytest.raises(ModelLoadError, match="not supported for qwen2-vl"):
        load(qwen2vl, pooling=pooling)


def test_extreme_aspect_ratio_is_the_inputs_fault(qwen2vl: Path) -> None:
    with pytest.raises(MMError) as info:
        load(qwen2vl).image_preprocessor()(Image.new("RGB", (1000, 4)))
    assert (info.value.code, info.value.stage, info.value.reason) == (422, "preprocess", "preprocess.unsupported_shape")


def test_custom_processor_falls_back_to_worker_side_processor(qwen2vl: Path) -> None:
    """A processor subclass the uint8 path cannot vouch for runs whole in the worker (float32)."""
    from transformers import AutoImageProcessor

    from mmenc_cli.encoders import probe_model
    from mmenc_cli.encoders.qwen_vl import QwenVLEncoder, load_vision_tower

    base = AutoImageProcessor.from_pretrained(qwen2vl, backend="pil")

    class Custom(type(base)):  # type: ignore[misc]
        def rescale(self, image: Any, scale: float, **kwargs: Any) -> Any:
            return super().rescale(image, scale, **kwargs)

    processor = Custom.from_pretrained(qwen2vl)
    cfg = ModelConfig(model=str(qwen2vl), pooling="tokens", device="cpu", dtype="float32")
    probe = probe_model(cfg)
    visual, weights = load_vision_tower(probe, cfg, __import__("torch").float32)
    enc = QwenVLEncoder(probe, cfg, "cpu", visual, processor, pooling="tokens", weights=weights)
    assert enc.info["image_input"] == "float32-patches"
    imgs = images([(90, 60), (40, 30)])
    got = enc.encode("image", [enc.image_preprocessor()(im) for im in imgs]).vectors
    ref = load(qwen2vl).encode("image", [load(qwen2vl).image_preprocessor()(im) for im in imgs]).vectors
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
