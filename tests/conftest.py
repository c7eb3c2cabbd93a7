"""Shared fixtures: offline hub settings, tiny models built once per session, small manifests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests import modelfactory


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return modelfactory.make_tiny_clip(tmp_path_factory.mktemp("models") / "clip")


@pytest.fixture(scope="session")
def tiny_st(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return modelfactory.make_tiny_st(tmp_path_factory.mktemp("models") / "st")


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write rows (dicts, or raw strings for invalid lines) as JSONL."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def make_image(path: Path, size: tuple[int, int] = (40, 30), seed: int = 0, fmt: str | None = None) -> Path:
    """A small random RGB image file."""
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path, format=fmt)
    return path


@pytest.fixture
def small_manifest(tmp_path: Path) -> Path:
    """12 rows: images, texts and pairs, all valid."""
    rows = []
    for i in range(12):
        row: dict[str, Any] = {"id": f"r{i}"}
        if i % 3 != 2:
            row["image"] = make_image(tmp_path / f"img{i}.png", (20 + i, 16 + i), seed=i).name
        if i % 3 != 0:
            row["text"] = f"a photo of thing {i} " * (1 + i % 4)
        row["label"] = i
        rows.append(row)
    return write_jsonl(tmp_path / "manifest.jsonl", rows)
