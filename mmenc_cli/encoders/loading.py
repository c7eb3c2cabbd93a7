"""Finding a model and loading its parts through transformers: config, weights, tokenizer, image processor.

`probe_model` locates a model (a local folder or a hub id, at `--revision`) and reads its config
(and a sentence-transformers `modules.json`) before any weights load; the families in
`encoders/__init__.py` recognise it from that `ModelProbe`. `load_model` and `load_part` load
through transformers' Auto classes with `trust_remote_code` as asked and safetensors-only weights
unless `allow_pickle_weights`. Every failure is a `ModelLoadError` (one clear line, exit 3).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ModelLoadError, first_line
from .hub import check_hub

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

log = logging.getLogger("mmenc")

_HUGE = 1_000_000  # tokenizers without a limit report int(1e30) as model_max_length


#: any of these means the model ships a tokenizer
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt", "vocab.json", "spiece.model",
                   "tokenizer.model", "sentencepiece.bpe.model")


@dataclass(frozen=True)
class ModelProbe:
    """What a family needs to recognise a model, read before any weights load.

    `source` is a local directory (absolute) or a hub id; `st_modules` the parsed `modules.json`
    of a sentence-transformers model (None otherwise); `config` the transformers config of the
    (transformer module of the) model; `commit` the resolved hub commit, None for local folders.
    """

    source: str
    revision: str | None
    config: Any
    model_type: str | None
    st_modules: list[dict[str, Any]] | None
    commit: str | None


def probe_model(cfg: "ModelConfig") -> ModelProbe:
    """Locate the model and read its config (and `modules.json`), without loading weights."""
    source = cfg.model
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model path {source!r} is not a directory")
        source = str(path.resolve())
    elif _looks_like_path(source):
        raise ModelLoadError(f"model directory not found: {source}")
    else:
        check_hub(source, cfg.revision)  # an offline node: one clear line, not the hub client's retries

    modules_file = fetch_file(source, "modules.json", cfg.revision)
    st_modules = None
    subfolder = ""
    if modules_file is not None:
        try:
            st_modules = sorted(json.loads(modules_file.read_text()), key=lambda m: m.get("idx", 0))
        except (ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{source}: modules.json is not valid: {exc}") from exc
        first = st_modules[0] if st_modules else {}
        if not str(first.get("type", "")).endswith(".Transformer"):
            # not a transformers-backed model: the sentence-transformers family explains why
            return ModelProbe(source, cfg.revision, None, None, st_modules, _commit_of(modules_file))
        subfolder = first.get("path", "") or ""

    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, revision=cfg.revision, subfolder=subfolder,
                                            trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:  # OSError (missing, offline), ValueError (unknown type, remote code)
        text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise ModelLoadError(f"cannot load model {cfg.model!r}: {text}") from exc
    commit = _commit_of(fetch_file(source, "config.json", cfg.revision, subfolder))
    return ModelProbe(source, cfg.revision, config, getattr(config, "model_type", None), st_modules, commit)


def fetch_file(source: str, filename: str, revision: str | None = None, subfolder: str = "") -> Path | None:
    """A file of the model (local folder or hub cache/download), or None when it has none."""
    local = Path(source)
    if local.is_dir():
        path = local / subfolder / filename
        return path if path.is_file() else None
    from transformers.utils import cached_file

    try:
        found = cached_file(source, filename, revision=revision, subfolder=subfolder,
                            _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False,
                            _raise_exceptions_for_gated_repo=False)
    except Exception:  # unreachable or invalid id: the config load that follows says why
        return None
    return Path(found) if found else None


def _looks_like_path(source: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that does not exist is a missing folder."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or os.sep != "/" and os.sep in source


def _commit_of(path: Path | None) -> str | None:
    """The commit hash of a file in the hub cache (`.../snapshots/<commit>/...`)."""
    parts = path.parts if path is not None else ()
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else None


def hub_kwargs(probe: ModelProbe, cfg: "ModelConfig", subfolder: str = "") -> dict[str, Any]:
    """The keyword arguments every `from_pretrained` call of one model shares."""
    kwargs: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if subfolder:
        kwargs["subfolder"] = subfolder
    return kwargs


def load_model(probe: ModelProbe, cfg: "ModelConfig", device: str, dtype: "torch.dtype",
               subfolder: str = "") -> tuple[Any, set[str]]:
    """`AutoModel` in `dtype` on `device` in eval mode, plus the weight names the checkpoint lacked.

    Safetensors only unless `cfg.allow_pickle_weights` (then safetensors are still preferred:
    `use_safetensors=None`, since `False` would refuse a safetensors-only folder).
    """
    from transformers import AutoModel

    kwargs = hub_kwargs(probe, cfg, subfolder)
    kwargs.update(dtype=dtype, output_loading_info=True,
                  use_safetensors=None if cfg.allow_pickle_weights else True)
    try:
        model, loading = AutoModel.from_pretrained(probe.source, **kwargs)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... here
        message = first_line(exc)
        if not cfg.allow_pickle_weights and "safetensors" in message:
            message += (" (mmenc loads only safetensors weights; if this model ships only pickle "
                        "weights such as pytorch_model.bin and you trust it, pass --allow-pickle-weights)")
        raise ModelLoadError(f"cannot load model {probe.source!r}: {message}") from exc
    missing = set(loading.get("missing_keys") or ())
    if missing:
        log.warning("%s: %d weight(s) missing from the checkpoint, randomly initialized: %s",
                    probe.source, len(missing), ", ".join(sorted(missing)[:5]))
    return model.to(device).eval(), missing


def load_part(kind: str, probe: ModelProbe, cfg: "ModelConfig",
              subfolder: str = "") -> tuple[Any, str | None]:
    """The model's tokenizer (`kind="text"`), image processor (`kind="image"`), audio feature
    extractor (`kind="audio"`) or video processor (`kind="video"`), or (None, why).

    Image processors are loaded with the PIL backend: it is transformers' reference
    implementation, identical with or without torchvision, and the one the uint8 path reproduces.
    """
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    kwargs = hub_kwargs(probe, cfg, subfolder)
    if kind == "text" and not any(fetch_file(probe.source, name, cfg.revision, subfolder)
                                  for name in TOKENIZER_FILES):
        # transformers 5 would build an empty-vocabulary tokenizer from the model type alone
        return None, "no tokenizer files"
    try:
        if kind == "text":
            return AutoTokenizer.from_pretrained(probe.source, **kwargs), None
        if kind == "audio":
            return AutoFeatureExtractor.from_pretrained(probe.source, **kwargs), None
        if kind == "video":
            from transformers import AutoVideoProcessor

            return AutoVideoProcessor.from_pretrained(probe.source, **kwargs), None
        try:
            return AutoImageProcessor.from_pretrained(probe.source, backend="pil", **kwargs), None
        except TypeError:  # remote-code processors that do not take `backend`
            return AutoImageProcessor.from_pretrained(probe.source, **kwargs), None
    except Exception as exc:  # absent files or unusable processor: the modality is unavailable
        what = {"text": "tokenizer", "image": "image processor", "audio": "audio feature extractor",
                "video": "video processor"}[kind]
        return None, f"no usable {what}: {first_line(exc)}"


def text_limit(tokenizer: Any, config: Any, declared: int | None, requested: int | None) -> int:
    """Token limit: the model's own (`declared`, else the tokenizer's if sane, else position
    embeddings), lowered by `--max-length` if given (it caps, never extends past the model)."""
    tok = getattr(tokenizer, "model_max_length", None)
    tok = tok if isinstance(tok, int) and 0 < tok < _HUGE else None
    positions = getattr(config, "max_position_embeddings", None)
    limit = declared or tok or positions or requested
    if limit is None:
        raise ModelLoadError("cannot tell the model's token limit; pass --max-length")
    if requested and requested > limit:
        log.warning("--max-length %d exceeds the model's limit of %d tokens; using %d",
                    requested, limit, limit)
    return min(limit, requested) if requested else limit
