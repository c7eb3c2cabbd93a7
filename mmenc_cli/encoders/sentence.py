"""sentence-transformers text models, run with plain transformers (no sentence-transformers import).

A model folder lists its modules in `modules.json`: a `Transformer` (at the root or in a
subfolder such as `0_Transformer/`), a `Pooling` (`1_Pooling/config.json`: the legacy
`pooling_mode_*` flags or the newer `pooling_mode` name/list) and optionally `Normalize`. The
encoder returns the pooled vectors un-normalized; `default_normalize` tells the pipeline whether
the model lists `Normalize` (the pipeline then L2-normalizes, as that module would). Any other
module (Dense, Router, StaticEmbedding, ...) is refused at load time rather than silently skipped.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ModelLoadError
from .device import resolve_dtype
from .hf import HFEncoder, Inputs, keep_accepted
from .loading import ModelProbe, fetch_file, load_model, load_part, text_limit

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

#: legacy `pooling_mode_*` flags, in the order sentence-transformers concatenates them
LEGACY_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean",
                "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean",
                "pooling_mode_lasttoken": "lasttoken"}


def _pool_cls(tokens: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    first = mask.int().argmax(dim=1)  # first attended position: left padding safe
    return tokens[_rows(tokens), first]


def _pool_max(tokens: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    return tokens.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).max(dim=1).values


def _masked_sum(tokens: "torch.Tensor", mask: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    m = mask.unsqueeze(-1).to(tokens.dtype)
    return (tokens * m).sum(dim=1), m.sum(dim=1).clamp(min=1e-9)


def _pool_mean(tokens: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    total, count = _masked_sum(tokens, mask)
    return total / count


def _pool_mean_sqrt(tokens: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    total, count = _masked_sum(tokens, mask)
    return total / count.sqrt()


def _pool_weightedmean(tokens: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    import torch

    # position weights 1, 2, ... counted from the first real token (left padding shifts them)
    positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device).view(1, -1)
    weights = ((positions - mask.int().argmax(dim=1, keepdim=True)) * mask).unsqueeze(-1).to(tokens.dtype)
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def _pool_lasttoken(tokens: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    rows = _rows(tokens)
    last = tokens.shape[1] - 1 - mask.int().flip(1).argmax(dim=1)  # last attended position
    return tokens[rows, last] * mask[rows, last].unsqueeze(-1).to(tokens.dtype)


def _rows(tokens: "torch.Tensor") -> "torch.Tensor":
    import torch

    return torch.arange(tokens.shape[0], device=tokens.device)


POOLERS: dict[str, Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]] = {
    "cls": _pool_cls, "max": _pool_max, "mean": _pool_mean, "mean_sqrt_len_tokens": _pool_mean_sqrt,
    "weightedmean": _pool_weightedmean, "lasttoken": _pool_lasttoken}


def pooling_modes(config: dict[str, Any]) -> tuple[str, ...]:
    """The pooling modes of a `1_Pooling/config.json`, in concatenation order (legacy or new keys)."""
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for flag, mode in LEGACY_FLAGS.items() if config.get(flag)] or ["mean"]
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    unknown = [m for m in modes if m not in POOLERS]
    if unknown:
        raise ModelLoadError(f"unsupported sentence-transformers pooling mode(s): {', '.join(unknown)}")
    return modes


class SentenceEncoder(HFEncoder):
    """A sentence-transformers text model: transformer token embeddings -> ST pooling (float32)."""

    family = "sentence-transformers"
    towers = frozenset({"text"})

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 modes: tuple[str, ...], **kwargs: Any) -> None:
        self._modes = modes
        self._keys = keep_accepted(model.forward)
        super().__init__(probe, cfg, device, model, **kwargs)

    def _embed_text(self, inputs: Inputs) -> "torch.Tensor":
        import torch

        # pool in float32 so half-precision models do not lose the sums (ST accumulates in float32 too)
        tokens = self.model(**self._keys(inputs))[0].float()
        mask = inputs["attention_mask"]
        return torch.cat([POOLERS[m](tokens, mask) for m in self._modes], dim=-1)


def load(probe: ModelProbe, cfg: "ModelConfig", device: str) -> HFEncoder:
    """Load a sentence-transformers model. `--pooling cls|mean` overrides the model's own pooling."""
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in probe.st_modules or []]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ModelLoadError(f"{probe.source}: unsupported sentence-transformers modules {kinds}: mmenc "
                             "supports Transformer + Pooling (+ Normalize)")
    module_dir = probe.st_modules[0].get("path", "") or ""
    modes = pooling_modes(_read_json(probe, probe.st_modules[1].get("path", ""), "config.json"))
    if cfg.pooling != "auto":
        modes = (cfg.pooling,)
    settings = _read_json(probe, module_dir, "sentence_bert_config.json")

    model, _ = load_model(probe, cfg, device, resolve_dtype(cfg.dtype, device), subfolder=module_dir)
    tokenizer, no_text = load_part("text", probe, cfg, subfolder=module_dir)
    if tokenizer is None:
        raise ModelLoadError(f"{probe.source}: {no_text}")
    max_length = text_limit(tokenizer, probe.config, settings.get("max_seq_length"), cfg.max_length)
    return SentenceEncoder(probe, cfg, device, model, modes=modes, tokenizer=tokenizer,
                           max_length=max_length, lowercase=bool(settings.get("do_lower_case")),
                           default_normalize="Normalize" in kinds, pooling="+".join(modes))


def _read_json(probe: ModelProbe, folder: str, name: str) -> dict[str, Any]:
    """A module's JSON settings file, {} when the model has none."""
    path = fetch_file(probe.source, name, probe.revision, folder)
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{probe.source}: {folder}/{name} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}
