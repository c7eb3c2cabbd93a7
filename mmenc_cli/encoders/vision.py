"""Image-only backbones through transformers (ViT, DINOv2, ConvNeXt, ...): pooled image embeddings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ModelLoadError
from .device import resolve_dtype
from .hf import HFEncoder, Inputs, keep_accepted
from .loading import ModelProbe, load_model, load_part

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

#: ViT-style models whose sequence starts with CLS (+ DeiT's distillation token, + DINOv2/v3
#: registers): the only ones where `cls` and `mean` pooling are well defined.
PREFIX_TOKENS: dict[str, int] = {"vit": 1, "vit_msn": 1, "deit": 2, "dinov2": 1,
                                 "dinov2_with_registers": 1, "dinov3_vit": 1}


class VisionEncoder(HFEncoder):
    """An image-only backbone (ViT, DINOv2, ...): pooled from the model's forward output.

    * `cls`: `last_hidden_state[:, 0]` (after the final layer norm, as DINOv2 and ViT output it).
    * `mean`: mean over the patch tokens only, excluding CLS and any distillation/register tokens:
      the convention of DINOv2's own linear-probe head and of timm's `global_pool="avg"`.
    * `auto`: the model's own `pooler_output` if it produces one from trained weights (ViT's
      dense+tanh pooler, DINOv2's normed CLS, ConvNeXt's pooled features), else `cls`.
    """

    family = "vision"
    towers = frozenset({"image"})

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 prefix: int | None, pooler_ok: bool, **kwargs: Any) -> None:
        self._prefix, self._pooler_ok = prefix, pooler_ok
        self._pooling = kwargs["pooling"]  # "auto" is settled by the load-time probe
        self._keys = keep_accepted(model.forward)
        super().__init__(probe, cfg, device, model, **kwargs)
        self.info["pooling"] = self._pooling

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        out = self.model(**self._keys(inputs))
        if self._pooling == "auto":
            if self._pooler_ok and getattr(out, "pooler_output", None) is not None:
                self._pooling = "pooler"
            elif self._prefix is not None:
                self._pooling = "cls"
            else:
                raise ModelLoadError(f"{self.info['model']}: {self.info['model_type']!r} has no usable "
                                     "pooler output and no CLS token mmenc knows how to pool")
        if self._pooling == "pooler":
            return out.pooler_output.flatten(1)
        hidden = out.last_hidden_state
        if self._pooling == "cls":
            return hidden[:, 0]
        return hidden[:, self._prefix:].mean(dim=1)


def load(probe: ModelProbe, cfg: "ModelConfig", device: str) -> HFEncoder:
    """Load an image-only backbone; `cls`/`mean` need a ViT-style model (see `PREFIX_TOKENS`)."""
    model_type = probe.model_type or ""
    prefix = None
    if model_type in PREFIX_TOKENS:
        prefix = PREFIX_TOKENS[model_type] + int(getattr(probe.config, "num_register_tokens", 0) or 0)
    elif cfg.pooling in ("cls", "mean"):
        raise ModelLoadError(f"--pooling {cfg.pooling} is defined only for ViT-style models "
                             f"({', '.join(sorted(PREFIX_TOKENS))}), not {model_type!r}; use --pooling auto")
    model, missing = load_model(probe, cfg, device, resolve_dtype(cfg.dtype, device))
    processor, no_image = load_part("image", probe, cfg)
    if processor is None:
        raise ModelLoadError(f"{probe.source}: {no_image}")
    # a pooler whose weights the checkpoint lacks (e.g. ViTForImageClassification weights loaded
    # into ViTModel) is random: never use it for `auto`
    pooler_ok = not any(k.startswith("pooler.") for k in missing)
    return VisionEncoder(probe, cfg, device, model, prefix=prefix, pooler_ok=pooler_ok,
                         image_processor=processor, default_normalize=False, pooling=cfg.pooling)
