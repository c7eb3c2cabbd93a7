"""The shared body of the transformers-backed adapters (`HFEncoder`).

`HFEncoder` adds to `torch_encoder.TorchEncoder` (model, device, batch forward, image batches,
the load-time probe) what every transformers family needs for text: tokenizing with honest
truncation flags, and pretokenizing windows of texts so batches only pad. A family subclass
(`clip.py`, `vision.py`, `sentence.py`) only says how inputs become vectors (`_embed_image` /
`_embed_text`).
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .base import AudioPreprocessor
from .device import to_device
from .forward import Inputs
from .loading import ModelProbe
from .preprocess import plan_image_input
from .torch_encoder import TorchEncoder

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

__all__ = ["HFEncoder", "Inputs", "TokenizedText", "keep_accepted", "pooled"]

#: texts are cut at this many characters per token of the model's limit before tokenizing: the
#: tokenizer keeps only the first `max_length` tokens anyway, and ordinary text has far fewer
#: characters per token (about 4 in English), so the cut changes no embedding unless a text
#: averages more than this per token; it bounds a huge text's tokenizing time and memory
CHARS_PER_TOKEN = 64


def keep_accepted(fn: Callable[..., Any]) -> Callable[[Inputs], Inputs]:
    """A filter keeping only the inputs `fn` names: tokenizers return extras (token_type_ids) that
    some models' feature functions would reject."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if not names:  # a bare `forward(**kwargs)` (remote code): nothing to filter on
        return lambda inputs: inputs
    return lambda inputs: {k: v for k, v in inputs.items() if k in names}


PRETOKENIZE_CHUNK = 2048  # texts per tokenizer call when pretokenizing a window


@dataclass(slots=True)
class TokenizedText:
    """One text tokenized without padding: the tokenizer's per-text features (input_ids, and
    token_type_ids where the model has them) and whether truncation cut it."""

    features: dict[str, list[int]]
    truncated: bool

    def __len__(self) -> int:
        return len(self.features["input_ids"])


class HFEncoder(TorchEncoder):
    """Shared body of the transformers-backed adapters.

    Subclasses set `family` and `towers` (the modalities they embed) and implement
    `_embed_image(inputs)` and/or `_embed_text(inputs)` returning `[n, dim]` tensors; a modality
    is offered when its tower exists and its processor/tokenizer loaded.
    """

    family = "hf"
    library = "transformers"

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 tokenizer: Any = None, image_processor: Any = None, max_length: int | None = None,
                 pad_to_max_length: bool = False, lowercase: bool = False, default_normalize: bool,
                 pooling: str, unavailable: dict[str, str] | None = None,
                 audio: AudioPreprocessor | None = None) -> None:
        self._tokenizer = tokenizer
        self.max_text_chars = None if max_length is None else max_length * CHARS_PER_TOKEN
        self._padding = "max_length" if pad_to_max_length else True
        self._lowercase = lowercase
        super().__init__(probe, cfg, device, model,
                         images=None if image_processor is None else plan_image_input(image_processor),
                         text=tokenizer is not None, default_normalize=default_normalize, pooling=pooling,
                         max_length=max_length, unavailable=unavailable, audio=audio)

    def text_pretokenizer(self, other_thread: bool) -> Callable[[Sequence[str]], list["TokenizedText"]] | None:
        """`pretokenize`; on a copy of the tokenizer for `other_thread` (a fast tokenizer's
        truncation and padding are set on it at every call, so the thread that pads batches and
        another that tokenizes must not share one)."""
        if "text" not in self.modalities:
            return None
        if not other_thread:
            return self.pretokenize
        return functools.partial(self.pretokenize, tokenizer=copy.deepcopy(self._tokenizer))

    # -- inputs

    def pretokenize(self, texts: Sequence[str], tokenizer: Any = None) -> list["TokenizedText"]:
        """Tokenize texts without padding (truncated at `max_length`), a few thousand per call.

        The pipeline sorts a window of texts by these token counts before cutting it into
        batches, and `encode` then only pads: bucketing by tokens instead of characters leaves
        ~1.04x the real tokens in the batches instead of ~1.13x (benchmark corpus, windows of 4096).
        Calls take `PRETOKENIZE_CHUNK` texts: a fast tokenizer's full `Encoding` objects (tokens,
        offsets, ...) of a whole window would cost several times what is kept (the id lists).
        """
        tokenizer = self._tokenizer if tokenizer is None else tokenizer
        out: list[TokenizedText] = []
        for start in range(0, len(texts), PRETOKENIZE_CHUNK):
            part = texts[start:start + PRETOKENIZE_CHUNK]
            part = [t.lower() for t in part] if self._lowercase else list(part)
            enc = tokenizer(part, padding=False, truncation=True, max_length=self.max_length,
                            return_attention_mask=False)
            truncated = self._truncated(part, enc, tokenizer)
            keys = [k for k in enc.keys() if k != "attention_mask"]
            out += [TokenizedText({k: enc[k][i] for k in keys}, truncated[i]) for i in range(len(part))]
        return out

    def _truncated(self, texts: Sequence[str], enc: Any, tokenizer: Any = None) -> list[bool]:
        encodings = getattr(enc, "encodings", None)
        if encodings:  # fast tokenizers record the cut-off tail: no second pass needed
            return [bool(e.overflowing) for e in encodings]
        full = (tokenizer or self._tokenizer)(texts, truncation=False, padding=False)["input_ids"]
        return [len(ids) > self.max_length for ids in full]

    def _pad(self, items: Sequence["TokenizedText"]) -> tuple[Inputs, list[bool]]:
        """Pad pretokenized texts exactly as the tokenizer pads when it tokenizes (side, ids, mask)."""
        import torch

        # the tokenizer warns that __call__ is faster than encode-then-pad: not when the pad is
        # all that is left to do
        warned = getattr(self._tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["Asking-to-pad-a-fast-tokenizer"] = True
        features = {k: [it.features[k] for it in items] for k in items[0].features}
        limit = {"max_length": self.max_length} if self._padding == "max_length" else {}
        enc = self._tokenizer.pad(features, padding=self._padding, return_tensors="np", **limit)
        tensors = {k: to_device(torch.from_numpy(np.ascontiguousarray(v)), self.device) for k, v in enc.items()}
        return tensors, [it.truncated for it in items]

    def tokenize(self, texts: Sequence[Any]) -> tuple[Inputs, list[bool]]:
        """Tokenize with truncation at `max_length`; also say which texts lost tokens.

        `texts` are strings, or `TokenizedText`s from `pretokenize` (then only padded)."""
        import torch

        if any(isinstance(t, TokenizedText) for t in texts):
            return self._pad([t if isinstance(t, TokenizedText) else self.pretokenize([t])[0] for t in texts])
        texts = [t.lower() for t in texts] if self._lowercase else list(texts)
        # numpy, then a zero-copy `from_numpy`: transformers builds "pt" tensors with
        # `torch.tensor(list of lists)`, which costs more than the tokenizing itself on short texts
        enc = self._tokenizer(texts, padding=self._padding, truncation=True, max_length=self.max_length,
                              return_tensors="np")
        truncated = self._truncated(texts, enc)
        return {k: to_device(torch.from_numpy(np.ascontiguousarray(v)), self.device) for k, v in enc.items()}, truncated


def pooled(output: Any) -> "torch.Tensor":
    """`get_*_features` returns a tensor in transformers 4 and a model output in 5 (projected
    embeddings in `pooler_output`)."""
    import torch

    return output if isinstance(output, torch.Tensor) else output.pooler_output
