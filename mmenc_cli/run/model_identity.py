"""How an output knows its model: a hub id by its name (and the commit it resolved to, `admission.py`),
a local folder by what it holds, never by where it lies.

A folder's content stamp hashes, for each file that makes the model (configs, tokenizer files,
weights, code: `MODEL_FILES`), its path inside the folder, its size and its bytes: whole for a file
up to `WHOLE`, else `BLOCKS` blocks of `BLOCK` bytes spread over it, first and last included. A
10 GB folder costs a few MB of reads; retrained weights differ in every block, so two trainings of
one shape are told apart. Moving or copying the folder (a node-local copy under Slurm or
Kubernetes, a renamed mount) keeps the stamp; a README edited beside the weights does not change it.

Outputs written before the stamp existed recorded the folder's absolute path and a hash of its
config files and weight sizes (`legacy_stamp`); they resume where both still match.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ..encoders.libraries import LIBRARIES, canonical_model, model_path

#: the endings of the files that make a model (README, images, .git and the like do not)
MODEL_FILES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".txt", ".model", ".tiktoken", ".py",
               ".npz", ".msgpack", ".h5", ".onnx", ".gguf")
WHOLE = 4 << 20  # files up to this size are hashed whole
BLOCK = 64 << 10
BLOCKS = 32
PREFIX = "c2:"  # marks a content stamp; an earlier output's stamp has none
#: the model shipped with mmenc (random weights), used when no --model is given
DEMO_MODEL = Path(__file__).resolve().parents[1] / "demo_model"


def is_demo(model: str) -> bool:
    """Whether `--model` names the bundled demo model."""
    path = model_path(model)
    return path is not None and path.resolve() == DEMO_MODEL


def _model_files(root: Path) -> list[tuple[str, Path]]:
    """(path inside the folder, path) of each file that makes the model, sorted; hidden files and
    folders (`.git`, `.cache`) left out, links followed."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if not name.startswith(".") and name.lower().endswith(MODEL_FILES):
                path = Path(folder) / name
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _hash_file(h: Any, path: Path) -> None:
    """Feed `path`'s size and bytes (whole, or sampled blocks of a large file) to `h`."""
    size = path.stat().st_size
    h.update(f"{size}\n".encode())
    with open(path, "rb") as fh:
        if size <= WHOLE:
            h.update(fh.read())
            return
        step = (size - BLOCK) / (BLOCKS - 1)
        for i in range(BLOCKS):
            fh.seek(int(i * step))
            h.update(fh.read(BLOCK))


def content_stamp(folder: Path) -> str:
    """The content stamp of a model folder (see the module docstring)."""
    h = hashlib.sha256()
    for rel, path in _model_files(folder):
        h.update(rel.encode("utf-8", "surrogateescape") + b"\n")
        _hash_file(h, path)
    return PREFIX + h.hexdigest()[:24]


def legacy_stamp(folder: Path) -> str:
    """What earlier mmenc versions recorded as a folder's stamp: its top-level JSON files (under
    1 MiB) and the sizes of its weight files."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        p = folder / name
        if name.endswith(".json") and p.is_file() and p.stat().st_size < 1 << 20:
            h.update(name.encode() + p.read_bytes())
        elif name.endswith((".safetensors", ".bin")):
            h.update(f"{name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _prefix(model: str) -> str:
    return next((f"{lib}:" for lib in LIBRARIES if model.startswith(f"{lib}:")), "")


def model_identity(model: str) -> dict[str, Any]:
    """The fingerprint's `model` and `model_stamp`: a hub id as given (no stamp); a local folder as
    `local-folder` behind its library's prefix, and its content stamp."""
    path = model_path(model)
    if path is None:
        return {"model": model, "model_stamp": None}
    return {"model": f"{_prefix(model)}local-folder", "model_stamp": content_stamp(path)}


def model_stamp(model: str) -> str | None:
    """A local folder's content stamp (None for a hub id)."""
    path = model_path(model)
    return None if path is None else content_stamp(path)


def legacy_identity(model: str) -> dict[str, Any] | None:
    """What an earlier version's fingerprint said of this model, for a local folder (None for a hub
    id, which it named as this version does)."""
    path = model_path(model)
    return None if path is None else {"model": canonical_model(model), "model_stamp": legacy_stamp(path)}


def is_legacy(recorded: dict[str, Any]) -> bool:
    """Whether a recorded fingerprint names a local folder the earlier way (its path)."""
    stamp = recorded.get("model_stamp")
    return isinstance(stamp, str) and not stamp.startswith(PREFIX)
