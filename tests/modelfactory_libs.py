"""Tiny random-weight OpenCLIP and timm models, saved the way each library saves them, and a
Hugging Face cache folder laid out as the hub client lays it out (so `hf-hub:` names and registry
names load offline through the libraries' own download code)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def need(module: str) -> Any:
    """Import a library these tests need; under CI=true its absence fails instead of skipping."""
    if os.environ.get("CI", "").lower() in ("1", "true"):
        return __import__(module)
    return pytest.importorskip(module)


def tiny_openclip_config(image_size: int | list[int] = 32) -> dict[str, Any]:
    """A CLIP of OpenCLIP's own format: ViT tower 2 layers x 32 wide, text 2 x 32, context 16
    (CLIP's BPE vocabulary, so OpenCLIP's SimpleTokenizer)."""
    return {"embed_dim": 16,
            "vision_cfg": {"image_size": image_size, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
            "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}


def make_tiny_openclip(folder: Path, image_size: int | list[int] = 32, seed: int = 0) -> Path:
    """`open_clip_config.json` + `open_clip_model.safetensors`, as OpenCLIP's hub export writes them."""
    import open_clip
    import torch
    from safetensors.torch import save_file

    config = tiny_openclip_config(image_size)
    torch.manual_seed(seed)
    model = open_clip.CLIP(**config)
    folder.mkdir(parents=True, exist_ok=True)
    preprocess = {"mean": [0.48, 0.46, 0.41], "std": [0.27, 0.26, 0.28], "interpolation": "bicubic",
                  "resize_mode": "shortest"}
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": config, "preprocess_cfg": preprocess}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "open_clip_model.safetensors"))
    return folder


def make_tiny_timm(folder: Path, arch: str = "test_vit", seed: int = 0) -> Path:
    """`config.json` + `model.safetensors` as `timm.models.save_for_hf` writes them (timm's own
    tiny test architectures: `test_vit` 0.4M parameters, `test_convnext` 0.3M)."""
    import timm
    import torch

    torch.manual_seed(seed)
    model = timm.create_model(arch, pretrained=False)
    folder.mkdir(parents=True, exist_ok=True)
    timm.models.save_for_hf(model, str(folder), safe_serialization=True)
    return folder


def into_hub_cache(cache: Path, repo: str, folder: Path) -> Path:
    """Copy a model folder into `cache` as the snapshot of `repo` at `COMMIT`, `refs/main`
    pointing at it (what `huggingface_hub` leaves after a download)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    shutil.copytree(folder, root / "snapshots" / COMMIT, dirs_exist_ok=True)
    return root / "snapshots" / COMMIT
