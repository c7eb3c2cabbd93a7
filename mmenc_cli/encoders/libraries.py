"""Models that another library builds: OpenCLIP and timm, by name, hub id or local folder.

`--model` names them as the libraries do, behind a prefix:

* `open_clip:ARCH/PRETRAINED` (OpenCLIP's own names), `open_clip:hf-hub:ORG/NAME`, and a local
  folder holding `open_clip_config.json` (with or without the prefix);
* `timm:NAME` (e.g. `timm:vit_base_patch16_224.augreg2_in21k_ft_in1k`), `timm:hf-hub:ORG/NAME`,
  and a local folder with timm's `config.json` (an `architecture` key; with or without the prefix).
  A hub repository of timm's (transformers calls its config `timm_wrapper`) goes to timm too.

Both are optional extras (`mmenc[openclip]`, `mmenc[timm]`): without them such a model is a
startup error naming the extra. Weights load from safetensors only unless
`--allow-pickle-weights`: the weight file each library would load is found first, and refused
when it is a pickle (`.bin`, `.pt`, `.pth`, `.npz`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from .loading import _commit_of

#: library -> (its import name, the mmenc extra that installs it)
LIBRARIES = {"open_clip": ("open_clip", "openclip"), "timm": ("timm", "timm")}


def split_model(model: str) -> tuple[str | None, str]:
    """(library, the name in the library's own terms) of `--model`; (None, model) for a model
    transformers loads. Local folders become `local-dir:ABSOLUTE_PATH`."""
    library, name = None, model
    for prefix in LIBRARIES:
        if model.startswith(prefix + ":"):
            library, name = prefix, model[len(prefix) + 1:]
    path = Path(name.removeprefix("local-dir:")).expanduser()
    if not name.startswith("hf-hub:") and path.is_dir():
        found = library or folder_library(path)
        return (found, f"local-dir:{path.resolve()}") if found else (None, model)
    return library, name


def folder_library(path: Path) -> str | None:
    """"open_clip" or "timm" for a folder those libraries wrote, else None."""
    if (path / "open_clip_config.json").is_file():
        return "open_clip"
    config = path / "config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text())
        except (OSError, ValueError):
            return None
        if isinstance(data, dict) and "architecture" in data and "model_type" not in data:
            return "timm"
    return None


def model_path(model: str) -> Path | None:
    """The local folder `--model` names (any prefix stripped), or None for a name or hub id."""
    name = split_model(model)[1]
    path = Path(name.removeprefix("local-dir:")).expanduser()
    return path if not name.startswith("hf-hub:") and path.is_dir() else None


def canonical_model(model: str) -> str:
    """`--model` as the output records it: a local folder as its absolute path (behind the
    library's prefix where one was given), anything else as given."""
    path = model_path(model)
    if path is None:
        return model
    prefix = next((f"{lib}:" for lib in LIBRARIES if model.startswith(f"{lib}:")), "")
    return prefix + str(path.resolve())


def import_library(library: str) -> Any:
    """The library's module, or a startup error naming the extra that installs it."""
    import importlib

    module, extra = LIBRARIES[library]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModelLoadError(f"this model needs the {library} library, which is not installed ({exc}): "
                             f"pip install 'mmenc[{extra}]'") from exc


def check_weights(model: str, found: str | None, allow_pickle: bool) -> str | None:
    """The weight file a library will load, refused when it is a pickle and pickles are not allowed;
    the hub commit it comes from (None for local files)."""
    if found is None:
        raise ModelLoadError(f"{model}: no weights found (looked for safetensors, then pickle files)")
    if not found.endswith(".safetensors") and not allow_pickle:
        raise ModelLoadError(f"{model}: its weights are {Path(found).name}, a pickle file; mmenc loads only "
                             "safetensors weights unless you trust this model and pass --allow-pickle-weights")
    return _commit_of(Path(found))


def hub_file(repo: str, names: tuple[str, ...], revision: str | None = None) -> str | None:
    """The first of `names` the hub repository has (from the cache when offline), or None."""
    from huggingface_hub import hf_hub_download

    for name in names:
        try:
            return hf_hub_download(repo_id=repo, filename=name, revision=revision)
        except Exception:  # absent, gated, offline and not cached: try the next name
            continue
    return None
