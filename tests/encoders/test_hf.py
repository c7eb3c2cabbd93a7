"""CLIP / SigLIP / SigLIP 2 and vision-backbone adapters against the models' own reference calls.

Every comparison runs mmenc's full path (worker preprocessor -> collate -> encode) on a batch of
images of different sizes or texts of different lengths, against the model's own processor and
`get_*_features` / forward output, in float32 on CPU: max |diff| <= 1e-5.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests import modelfactory as mf
from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import ModelLoadError, load_encoder, resolve_device, resolve_dtype

TOL = 1e-5
TEXTS = ["a photo of a cat", "x", "the red car is on the blue dog and a cat " * 4, "dog 42!"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: getattr(mf, f"make_tiny_{name}")(root / name)
            for name in ("clip", "siglip", "siglip2", "vit", "dinov2")}


def images() -> list[Image.Image]:
    rng = np.random.RandomState(1)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in [(37, 53), (64, 31), (120, 200), (32, 32)]]


def reference_model(path: Path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path).eval()


def encode_images(encoder, imgs: list[Image.Image]) -> torch.Tensor:
    prep = encoder.image_preprocessor()
    return encoder.encode("image", [prep(img) for img in imgs]).vectors


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["clip", "siglip", "siglip2"])
def test_dual_tower_matches_reference(models: dict[str, Path], name: str) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    path = models[name]
    encoder = load_encoder(ModelConfig(model=str(path)))
    assert encoder.modalities == {"image", "text", "video"} and encoder.default_normalize is True
    assert encoder.info["image_input"] == ("float32" if name == "siglip2" else "uint8")
    model = reference_model(path)
    processor, tokenizer = AutoImageProcessor.from_pretrained(path, backend="pil"), AutoTokenizer.from_pretrained(path)
    # SigLIP's text tower reads the last position: its documentation pads to max_length
    padding = True if name == "clip" else "max_length"
    with torch.inference_mode():
        ref_img = model.get_image_features(**processor(images=images(), return_tensors="pt")).pooler_output
        tok = tokenizer(TEXTS, padding=padding, truncation=True, return_tensors="pt")
        ref_txt = model.get_text_features(input_ids=tok["input_ids"],
                                          attention_mask=tok["attention_mask"]).pooler_output
    assert_close(encode_images(encoder, images()), ref_img)
    out = encoder.encode("text", TEXTS)
    assert_close(out.vectors, ref_txt)
    assert encoder.dim == ref_txt.shape[1]
    full = tokenizer(TEXTS, truncation=False)["input_ids"]
    assert out.truncated == [len(ids) > encoder.info["max_length"] for ids in full]
    assert out.truncated[2] and not out.truncated[1]


def test_clip_pools_at_the_eos_token(models: dict[str, Path]) -> None:
    """The factory's BERT tokenizer ends texts with [SEP]=3 = CLIP's eos_token_id: pooling reads it."""
    model = reference_model(models["clip"])
    ids = torch.tensor([[mf.CLS_ID, 40, 41, mf.SEP_ID, mf.PAD_ID]])
    with torch.inference_mode():
        out = model.text_model(input_ids=ids, attention_mask=(ids != 0).long())
    assert torch.equal(out.pooler_output, out.last_hidden_state[:, 3])


@pytest.mark.parametrize("name,pooling", [("vit", "auto"), ("vit", "cls"), ("vit", "mean"),
                                          ("dinov2", "auto"), ("dinov2", "cls"), ("dinov2", "mean")])
def test_vision_backbone_matches_reference(models: dict[str, Path], name: str, pooling: str) -> None:
    from transformers import AutoImageProcessor

    path = models[name]
    encoder = load_encoder(ModelConfig(model=str(path), pooling=pooling))
    assert encoder.modalities == {"image", "video"} and encoder.default_normalize is False
    model = reference_model(path)
    with torch.inference_mode():
        out = model(**AutoImageProcessor.from_pretrained(path, backend="pil")(images=images(), return_tensors="pt"))
    expected = {"auto": out.pooler_output, "cls": out.last_hidden_state[:, 0],
                "mean": out.last_hidden_state[:, 1:].mean(dim=1)}[pooling]
    assert_close(encode_images(encoder, images()), expected)
    assert encoder.info["pooling"] == {"auto": "pooler"}.get(pooling, pooling)
    if name == "vit" and pooling == "auto":  # ViT's pooler is dense+tanh, not the CLS token
        assert not torch.allclose(out.pooler_output, out.last_hidden_state[:, 0])


def test_vit_without_pooler_weights_falls_back_to_cls(models: dict[str, Path], tmp_path: Path) -> None:
    """A checkpoint lacking the pooler (e.g. a classifier's) must not use a random pooler for `auto`."""
    from safetensors.torch import load_file, save_file

    target = tmp_path / "vit-nopooler"
    shutil.copytree(models["vit"], target)
    weights = load_file(target / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("pooler.")}, target / "model.safetensors",
              metadata={"format": "pt"})
    encoder = load_encoder(ModelConfig(model=str(target)))
    assert encoder.info["pooling"] == "cls"
    cls = load_encoder(ModelConfig(model=str(models["vit"]), pooling="cls"))
    assert_close(encode_images(encoder, images()), encode_images(cls, images()))


def test_modalities_and_unsupported_poolings(models: dict[str, Path]) -> None:
    vit = load_encoder(ModelConfig(model=str(models["vit"])))
    assert "text" not in vit.modalities
    with pytest.raises(ValueError):
        vit.encode("text", ["hello"])
    with pytest.raises(ModelLoadError, match="--pooling tokens is not supported"):
        load_encoder(ModelConfig(model=str(models["vit"]), pooling="tokens"))
    with pytest.raises(ModelLoadError, match="--pooling cls is not supported for clip"):
        load_encoder(ModelConfig(model=str(models["clip"]), pooling="cls"))


def test_clip_without_tokenizer_is_image_only(models: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "clip-vision-only"
    shutil.copytree(models["clip"], target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).unlink()
    encoder = load_encoder(ModelConfig(model=str(target)))
    assert encoder.modalities == {"image", "video"}
    assert "text" in encoder.info["unavailable"]


def test_max_length_caps_tokens(models: dict[str, Path]) -> None:
    encoder = load_encoder(ModelConfig(model=str(models["clip"]), max_length=6))
    out = encoder.encode("text", ["a cat", "a photo of a red cat"])
    assert encoder.info["max_length"] == 6 and out.truncated == [False, True]


def test_missing_directory_and_unknown_hub_id() -> None:
    with pytest.raises(ModelLoadError, match="model directory not found"):
        load_encoder(ModelConfig(model="/nonexistent/mmenc/model"))
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_encoder(ModelConfig(model="mmenc-test-org/no-such-model"))  # HF_HUB_OFFLINE=1: fast


def test_pickle_weights_need_allow_pickle_weights(models: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    target = tmp_path / "vit-bin"
    shutil.copytree(models["vit"], target)
    torch.save(load_file(target / "model.safetensors"), target / "pytorch_model.bin")
    (target / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="--allow-pickle-weights"):
        load_encoder(ModelConfig(model=str(target)))
    encoder = load_encoder(ModelConfig(model=str(target), allow_pickle_weights=True))
    assert encoder.dim == 32


def test_unsupported_model_type(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(**mf.TINY, vocab_size=len(mf.VOCAB))).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported model .*'bert'"):
        load_encoder(ModelConfig(model=str(tmp_path)))


def test_device_and_dtype_resolution() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") in (expected, "mps")
    assert resolve_device("cpu") == "cpu"
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_compile_failure_falls_back_to_eager(models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    def broken_compile(fn, *args, **kwargs):
        def compiled(*a, **k):
            raise RuntimeError("inductor exploded")
        return compiled

    monkeypatch.setattr(torch, "compile", broken_compile)
    eager = load_encoder(ModelConfig(model=str(models["clip"])))
    encoder = load_encoder(ModelConfig(model=str(models["clip"]), compile=True))
    with caplog.at_level(logging.WARNING, logger="mmenc"):
        out = encoder.encode("text", TEXTS)
        encoder.encode("text", TEXTS)
    assert torch.equal(out.vectors, eager.encode("text", TEXTS).vectors)
    assert sum("torch.compile failed" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("name", ["clip", "siglip", "siglip2"])
def test_pretokenized_texts_give_the_same_inputs_and_vectors(models: dict[str, Path], name: str) -> None:
    """Token bucketing's pretokenize + pad equals tokenizing the strings (SigLIP pads to max_length)."""
    enc = load_encoder(ModelConfig(model=str(models[name]), device="cpu"), device="cpu")
    want_inputs, want_trunc = enc.tokenize(TEXTS)
    got_inputs, got_trunc = enc.tokenize(enc.pretokenize(TEXTS))
    assert got_trunc == want_trunc and got_inputs.keys() == want_inputs.keys()
    for k in want_inputs:
        assert torch.equal(got_inputs[k], want_inputs[k]), k
    assert torch.equal(enc.encode("text", enc.pretokenize(TEXTS)).vectors, enc.encode("text", TEXTS).vectors)
