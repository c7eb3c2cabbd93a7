"""OpenCLIP and timm models against the libraries' own calls (`encode_image`/`encode_text` through
OpenCLIP's preprocess and tokenizer; timm's `forward_features`/`forward_head` through its data
config's transform), on tiny random-weight models saved as each library saves them; every name
form offline from a hub cache; safety (pickles, missing extras) and the run metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import load_encoder
from mmenc_cli.errors import ModelLoadError
from tests import modelfactory_libs as ml

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5
TEXTS = ["a photo of a cat", "two dogs running on the beach at sunset " * 3, "hello", "Ünïcödé, punctuation!?"]


def images() -> list[Image.Image]:
    rng = np.random.RandomState(3)
    return [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in [(37, 53), (64, 31), (120, 200), (32, 32), (9, 70)]]


def encode_images(encoder, imgs: list[Image.Image]) -> torch.Tensor:
    prep = encoder.image_preprocessor()
    return encoder.encode("image", [prep(img) for img in imgs]).vectors


def close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    return float((ours - ref).abs().max())


@pytest.fixture(scope="module")
def openclip_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ml.need("open_clip")
    root = tmp_path_factory.mktemp("openclip")
    return {"square": ml.make_tiny_openclip(root / "square"),
            "wide": ml.make_tiny_openclip(root / "wide", image_size=[24, 40], seed=1)}


@pytest.fixture(scope="module")
def timm_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ml.need("timm")
    root = tmp_path_factory.mktemp("timm")
    return {arch: ml.make_tiny_timm(root / arch, arch) for arch in ("test_vit", "test_convnext")}


@pytest.mark.parametrize("kind", ["square", "wide"])
def test_openclip_matches_encode_image_and_encode_text(openclip_models: dict[str, Path], kind: str) -> None:
    import open_clip

    folder = openclip_models[kind]
    encoder = load_encoder(ModelConfig(model=str(folder)))
    assert encoder.modalities == {"image", "text", "video"} and encoder.default_normalize is True
    assert encoder.info["library"] == "open_clip" and encoder.info["library_version"] == open_clip.__version__
    # square: resize + center crop + normalize, split into uint8 workers; the non-square size
    # (OpenCLIP's keep-ratio resize) runs the library's own transform in the worker
    assert encoder.info["image_input"] == ("uint8" if kind == "square" else "float32")
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    with torch.inference_mode():
        ref_img = model.eval().encode_image(torch.stack([preprocess(img) for img in images()]))
        ref_txt = model.encode_text(tokenizer(TEXTS))
    assert close(encode_images(encoder, images()), ref_img) <= TOL
    out = encoder.encode("text", TEXTS)
    assert close(out.vectors, ref_txt) <= TOL
    assert encoder.dim == 16 and encoder.info["max_length"] == 16
    assert out.truncated == [len(tokenizer.encode(t)) + 2 > 16 for t in TEXTS] == [False, True, False, False]
    with pytest.raises(ModelLoadError, match="takes exactly its context length"):  # the tower's shape is fixed
        load_encoder(ModelConfig(model=str(folder), max_length=6))


@pytest.mark.parametrize("arch", ["test_vit", "test_convnext"])
@pytest.mark.parametrize("pooling", ["auto", "cls", "mean"])
def test_timm_matches_forward_features_and_head(timm_models: dict[str, Path], arch: str, pooling: str) -> None:
    import timm

    folder = timm_models[arch]
    cfg = ModelConfig(model=str(folder), pooling=pooling)
    if arch == "test_convnext" and pooling != "auto":  # no tokens: only timm's own pooling is defined
        with pytest.raises(ModelLoadError, match="--pooling auto"):
            load_encoder(cfg)
        return
    encoder = load_encoder(cfg)
    assert encoder.modalities == {"image", "video"} and encoder.default_normalize is False
    assert encoder.info["image_input"] == "uint8" and encoder.info["library"] == "timm"
    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model), is_training=False)
    with torch.inference_mode():
        features = model.forward_features(torch.stack([transform(img) for img in images()]))
        ref = {"auto": lambda: model.forward_head(features, pre_logits=True), "cls": lambda: features[:, 0],
               "mean": lambda: features[:, model.num_prefix_tokens:].mean(dim=1)}[pooling]()
    assert close(encode_images(encoder, images()), ref) <= TOL
    assert encoder.dim == ref.shape[1]


HUB_SCRIPT = r"""
import json, sys, torch
from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import load_encoder
from tests.encoders.test_libraries import encode_images, images, TEXTS
reference = {name: load_encoder(ModelConfig(model=path)) for name, path in json.loads(sys.argv[1]).items()}
out = {}
for model, ref in json.loads(sys.argv[2]).items():
    enc, want = load_encoder(ModelConfig(model=model)), reference[ref]
    diff = float((encode_images(enc, images()) - encode_images(want, images())).abs().max())
    if "text" in enc.modalities:
        diff = max(diff, float((enc.encode("text", TEXTS).vectors - want.encode("text", TEXTS).vectors).abs().max()))
    out[model] = {"diff": diff, "commit": enc.info["commit"], "family": enc.info["family"]}
print(json.dumps(out))
"""


def test_every_name_form_loads_offline_from_a_hub_cache(openclip_models: dict[str, Path],
                                                        timm_models: dict[str, Path], tmp_path: Path) -> None:
    """In a fresh process with HF_HUB_OFFLINE=1 and HF_HUB_CACHE set: the hub client's own cache
    lookup, the libraries' own download code, mmenc's own loading code."""
    cache = tmp_path / "hub"
    ml.into_hub_cache(cache, "mmenc-test/tiny-openclip", openclip_models["square"])
    ml.into_hub_cache(cache, "timm/test_vit.r160_in1k", timm_models["test_vit"])
    ml.into_hub_cache(cache, "mmenc-test/tiny-convnext", timm_models["test_convnext"])
    # OpenCLIP's ARCH/PRETRAINED form: an architecture and a tag registered the way OpenCLIP's
    # own are, whose weights live on the hub
    register = ("import open_clip, open_clip.factory as f, open_clip.pretrained as p;"
                f"f._MODEL_CONFIGS['mmenc-tiny'] = {ml.tiny_openclip_config()!r};"
                "p._PRETRAINED['mmenc-tiny'] = {'test': p._pcfg(hf_hub='mmenc-test/tiny-openclip/',"
                " mean=(0.48, 0.46, 0.41), std=(0.27, 0.26, 0.28))};")
    forms = {"open_clip:hf-hub:mmenc-test/tiny-openclip": "oc", "open_clip:mmenc-tiny/test": "oc",
             "timm:test_vit.r160_in1k": "vit", "timm:hf-hub:timm/test_vit.r160_in1k": "vit",
             "timm/test_vit.r160_in1k": "vit", "mmenc-test/tiny-convnext": "convnext"}
    local = {"oc": str(openclip_models["square"]), "vit": str(timm_models["test_vit"]),
             "convnext": f"timm:{timm_models['test_convnext']}"}
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", register + HUB_SCRIPT, json.dumps(local), json.dumps(forms)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert set(got) == set(forms)
    for model, facts in got.items():
        assert facts["diff"] <= TOL and facts["commit"] == ml.COMMIT, (model, facts)
    assert {f["family"] for f in got.values()} == {"open_clip", "timm"}


def test_pickle_weights_only_when_allowed(openclip_models: dict[str, Path], timm_models: dict[str, Path],
                                          tmp_path: Path) -> None:
    from safetensors.torch import load_file

    for name, folder, weights, pickled in (
            ("oc", openclip_models["square"], "open_clip_model.safetensors", "open_clip_pytorch_model.bin"),
            ("timm", timm_models["test_vit"], "model.safetensors", "pytorch_model.bin")):
        copy = tmp_path / name
        copy.mkdir()
        for f in folder.iterdir():
            if f.name != weights:
                (copy / f.name).write_bytes(f.read_bytes())
        torch.save(load_file(str(folder / weights)), copy / pickled)
        with pytest.raises(ModelLoadError, match=f"{pickled}, a pickle file.*--allow-pickle-weights"):
            load_encoder(ModelConfig(model=str(copy)))
        allowed = load_encoder(ModelConfig(model=str(copy), allow_pickle_weights=True))
        same = load_encoder(ModelConfig(model=str(folder)))
        assert close(encode_images(allowed, images()), encode_images(same, images())) == 0.0


def test_a_missing_library_is_a_startup_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch,
                                                               openclip_models: dict[str, Path],
                                                               timm_models: dict[str, Path]) -> None:
    monkeypatch.setitem(sys.modules, "open_clip", None)  # what `import open_clip` meets when absent
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(ModelLoadError, match=r"pip install 'mmenc\[openclip\]'"):
        load_encoder(ModelConfig(model=str(openclip_models["square"])))
    with pytest.raises(ModelLoadError, match=r"pip install 'mmenc\[timm\]'"):
        load_encoder(ModelConfig(model="timm:test_vit.r160_in1k"))
    with pytest.raises(ModelLoadError, match=r"mmenc\[timm\]"):
        load_encoder(ModelConfig(model=str(timm_models["test_vit"])))


def test_bad_names_and_options(openclip_models: dict[str, Path], timm_models: dict[str, Path]) -> None:
    ml.need("open_clip")
    with pytest.raises(ModelLoadError, match="names no pretrained weights"):
        load_encoder(ModelConfig(model="open_clip:ViT-B-32"))
    with pytest.raises(ModelLoadError, match="knows no pretrained 'nope' for 'ViT-B-32'"):
        load_encoder(ModelConfig(model="open_clip:ViT-B-32/nope"))
    with pytest.raises(ModelLoadError, match="timm knows no model"):
        load_encoder(ModelConfig(model="timm:no_such_model_anywhere"))
    with pytest.raises(ModelLoadError, match="--pooling tokens is not supported for open_clip models"):
        load_encoder(ModelConfig(model=str(openclip_models["square"]), pooling="tokens"))
    with pytest.raises(ModelLoadError, match="--revision"):
        load_encoder(ModelConfig(model=f"timm:{timm_models['test_vit']}", revision="v1"))


def test_a_run_with_decode_workers_then_a_resume_under_another_library_version(
        openclip_models: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Both image paths cross worker processes (uint8 split, and the library's transform), the
    vectors are OpenCLIP's normalized, the metadata names the library; a resume under another
    OpenCLIP version warns, naming both, and goes on."""
    import open_clip

    from mmenc_cli.config import BatchConfig, MediaConfig, RunConfig, WriterConfig
    from mmenc_cli.output import OutDir
    from mmenc_cli.output.embeddings import read_embeddings
    from mmenc_cli.run.pipeline import run_encode

    (tmp_path / "img").mkdir()
    rows = []
    for i, img in enumerate(images()):
        img.save(tmp_path / "img" / f"{i}.png")
        rows.append({"id": f"r{i}", "image": f"img/{i}.png", "text": TEXTS[i % len(TEXTS)]})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for kind, folder in openclip_models.items():
        out = tmp_path / kind
        cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(folder), device="cpu"),
                        writer=WriterConfig(out=str(out)), batch=BatchConfig(batch_size=2, workers=1),
                        media=MediaConfig(decode="exact"))  # the library's own pixels (fast resizes with torch)
        assert run_encode(cfg).counters.encoded == 2 * len(rows)
        model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
        with torch.inference_mode():
            pixels = torch.stack([preprocess(Image.open(tmp_path / r["image"]).convert("RGB")) for r in rows])
            ref = torch.nn.functional.normalize(model.eval().encode_image(pixels), dim=-1).numpy()
        ids, got = read_embeddings(out, "image")
        assert float(np.abs(got[np.argsort(ids)] - ref).max()) <= TOL
    meta = json.loads(OutDir(out).run_meta_path.read_text())
    assert meta["facts"]["library"] == "open_clip" and meta["versions"]["open_clip_torch"] == open_clip.__version__
    meta["versions"]["open_clip_torch"] = "0.0.1"
    OutDir(out).run_meta_path.write_text(json.dumps(meta))
    rows.append({"id": "new", "text": "one more"})
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING", logger="mmenc"):
        again = run_encode(cfg)
    assert again.counters.encoded_now == 1  # the rest was there
    assert f"open_clip_torch 0.0.1, this run has open_clip_torch {open_clip.__version__}" in caplog.text
