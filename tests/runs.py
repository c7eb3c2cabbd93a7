"""Helpers for tests that run the pipeline: a config for the fake encoder, reading outputs back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mmenc_cli.config import BatchConfig, ManifestConfig, MediaConfig, ModelConfig, RunConfig, WriterConfig
from mmenc_cli.output import OutDir
from mmenc_cli.output.embeddings import read_embeddings
from mmenc_cli.records import MODALITIES


def make_cfg(manifests: list[Path], out: Path, **kw: Any) -> RunConfig:
    """A RunConfig for the fake encoder on the CPU, in-process decoding unless workers given."""
    batch = BatchConfig(batch_size=kw.pop("batch_size", 4), workers=kw.pop("workers", 0))
    writer = WriterConfig(out=str(out), shard_size=kw.pop("shard_size", 5), format=kw.pop("format", "parquet"))
    media = MediaConfig(fetch_timeout=0.5, fetch_retries=0)
    man = ManifestConfig(keep=tuple(kw.pop("keep", ())), limit=kw.pop("limit", None))
    model = ModelConfig(model="fake", device="cpu", text_prefix=kw.pop("text_prefix", ""))
    return RunConfig(manifests=tuple(str(m) for m in manifests), model=model, writer=writer, batch=batch,
                     media=media, manifest=man, **kw)


def error_rows(out: Path) -> list[dict[str, Any]]:
    rows = []
    for p in OutDir(out).error_report_paths():
        rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return rows


def embeddings(out: Path) -> dict[tuple[str, str], np.ndarray]:
    """(id, modality) -> vector, asserting no (id, modality) appears twice."""
    got: dict[tuple[str, str], np.ndarray] = {}
    for modality in MODALITIES:
        ids, mat = read_embeddings(out, modality)
        for i, v in zip(ids, mat):
            assert (i, modality) not in got, f"duplicate {(i, modality)}"
            got[(i, modality)] = v
    return got
