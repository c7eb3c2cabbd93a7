"""OpenCLIP models through the `open_clip` library: image and text embeddings.

`open_clip:ARCH/PRETRAINED`, `open_clip:hf-hub:ORG/NAME` or a folder with `open_clip_config.json`
(`libraries.split_model`). The model, its evaluation transform and its tokenizer are the
library's own (`create_model_and_transforms`, `get_tokenizer`); vectors are `encode_image` /
`encode_text` un-normalized, and mmenc L2-normalizes them by default, as OpenCLIP users do
(`--no-normalize` keeps them raw). The transform splits into the uint8 worker path where it is
resize + center crop + normalize (`tv_transform.py`). A text is cut at the tokenizer's context
length (77 for CLIP; the tower takes exactly that many, so `--max-length` cannot lower it); it is
flagged truncated when its tokens, start and end included, exceed it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ModelLoadError, first_line
from .device import resolve_dtype, to_device
from .forward import Inputs
from .hf import CHARS_PER_TOKEN
from .libraries import check_weights, hub_file, import_library
from .loading import ModelProbe
from .torch_encoder import TorchEncoder
from .tv_transform import plan_transform

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

#: pickle weight names and the safetensors file OpenCLIP looks for first in their place
_SAFE_NAMES = {"open_clip_pytorch_model.bin": "open_clip_model.safetensors", "pytorch_model.bin": "model.safetensors"}
#: what OpenCLIP looks for in a local folder, in its order
_FOLDER_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "model.safetensors",
                 "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth", "pytorch_model.bin",
                 "pytorch_model.pth", "model.pth")


class OpenCLIPEncoder(TorchEncoder):
    """`model.encode_image(pixels)` and `model.encode_text(tokens)`."""

    family = "open_clip"
    towers = frozenset({"image", "text"})
    library = "open_clip"

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 tokenizer: Any, preprocess: Any) -> None:
        self._tokenizer = tokenizer
        context = int(tokenizer.context_length)
        if cfg.max_length is not None and cfg.max_length < context:
            raise ModelLoadError(f"--max-length {cfg.max_length}: an OpenCLIP text tower takes exactly its "
                                 f"context length ({context} tokens); drop --max-length")
        self.max_text_chars = context * CHARS_PER_TOKEN
        super().__init__(probe, cfg, device, model, images=plan_transform(preprocess), text=True,
                         default_normalize=True, pooling="projection", max_length=context)

    def tokenize(self, texts: Sequence[Any]) -> tuple[Inputs, list[bool]]:
        texts = list(texts)
        ids = self._tokenizer(texts)
        return {"input_ids": to_device(ids, self.device)}, self._truncated(texts)

    def _truncated(self, texts: list[str]) -> list[bool]:
        """Whether each text's tokens (with its start and end tokens) exceed the context length."""
        tok, limit = self._tokenizer, self.max_length
        inner = getattr(tok, "tokenizer", None)
        clean = getattr(tok, "clean_fn", lambda t: t)
        if inner is not None:  # HFTokenizer, SigLipTokenizer: a transformers tokenizer inside
            ids = inner([clean(t) for t in texts], truncation=False, padding=False)["input_ids"]
            return [len(i) > limit for i in ids]
        if hasattr(tok, "encode"):  # SimpleTokenizer (CLIP's BPE): encode() cleans, adds no ends
            return [len(tok.encode(t)) + 2 > limit for t in texts]
        return [False] * len(texts)

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        return self.model.encode_image(inputs["pixel_values"])

    def _embed_text(self, inputs: Inputs) -> "torch.Tensor":
        return self.model.encode_text(inputs["input_ids"])


def load(name: str, cfg: "ModelConfig", device: str) -> OpenCLIPEncoder:
    """Load an OpenCLIP model by its name in OpenCLIP's terms (`split_model`)."""
    open_clip = import_library("open_clip")
    if cfg.revision is not None:
        raise ModelLoadError("--revision is not supported for OpenCLIP models: OpenCLIP loads a hub "
                             "repository's main revision (pin one by downloading it to a folder)")
    arch, tag = _arch_and_tag(name)
    commit = check_weights(cfg.model, _weights(open_clip, name, arch, tag), cfg.allow_pickle_weights)
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(
            arch, pretrained=tag, weights_only=True)
        tokenizer = open_clip.get_tokenizer(arch)
    except Exception as exc:  # the library raises RuntimeError, ValueError, FileNotFoundError, ...
        raise ModelLoadError(f"cannot load model {cfg.model!r}: {first_line(exc)}") from exc
    model = model.to(device=device, dtype=resolve_dtype(cfg.dtype, device)).eval()
    probe = ModelProbe(cfg.model, cfg.revision, None, f"open_clip:{arch.split(':')[0]}", None, commit)
    return OpenCLIPEncoder(probe, cfg, device, model, tokenizer=tokenizer, preprocess=preprocess)


def _arch_and_tag(name: str) -> tuple[str, str | None]:
    """("hf-hub:ORG/NAME" or "local-dir:PATH", None) or (ARCH, PRETRAINED) of a plain name."""
    if name.startswith(("hf-hub:", "local-dir:")):
        return name, None
    arch, _, tag = name.partition("/")
    if not tag:
        raise ModelLoadError(f"open_clip:{name} names no pretrained weights: use open_clip:ARCH/PRETRAINED "
                             "(open_clip.list_pretrained() lists them), open_clip:hf-hub:ORG/NAME or a folder")
    return arch, tag


def _weights(open_clip: Any, name: str, arch: str, tag: str | None) -> str | None:
    """The weight file OpenCLIP will load for this name (safetensors first, as it does)."""
    if name.startswith("local-dir:"):
        folder = Path(name.removeprefix("local-dir:"))
        return next((str(folder / n) for n in _FOLDER_NAMES if (folder / n).is_file()), None)
    if name.startswith("hf-hub:"):
        return hub_file(name.removeprefix("hf-hub:"), ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"))
    pretrained = open_clip.get_pretrained_cfg(arch, tag)
    if not pretrained:
        if tag is not None and os.path.isfile(tag):
            return tag
        tags = ", ".join(open_clip.list_pretrained_tags_by_model(arch)) or "none"
        raise ModelLoadError(f"open_clip:{name}: OpenCLIP knows no pretrained {tag!r} for {arch!r} (known: {tags})")
    if pretrained.get("hf_hub"):
        repo, filename = os.path.split(pretrained["hf_hub"])
        filename = filename or "open_clip_pytorch_model.bin"
        return hub_file(repo, tuple(n for n in (_SAFE_NAMES.get(filename), filename) if n))
    return pretrained.get("url") or None
