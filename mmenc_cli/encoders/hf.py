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
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import numpy as np

from .base import AudioPreprocessor
from .device import to_device
from .early_table import EarlySource, EarlyTable, merge
from .forward import Inputs
from .loading import ModelProbe
from .preprocess import plan_image_input
from .tokens import PadSpec, TokenizedText, TokenizedTexts, features_of
from .torch_encoder import TorchEncoder

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

__all__ = ["HFEncoder", "Inputs", "TokenizedText", "TokenizedTexts", "keep_accepted", "pooled"]

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


def _tokenize_pool() -> ThreadPoolExecutor | None:
    """Threads that run a fast tokenizer's batch calls at once, one per usable CPU: the calls
    leave the GIL, so a window is tokenized on every core whatever TOKENIZERS_PARALLELISM says."""
    global _POOL
    if _POOL is None:
        from ..cpus import usable_cpus

        cpus = usable_cpus()
        _POOL = ThreadPoolExecutor(cpus, thread_name_prefix="mmenc-tokens") if cpus > 1 else False
    return _POOL or None


_POOL: ThreadPoolExecutor | Literal[False] | None = None


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
        self._early: EarlySource | None = None
        self._early_tables: dict[int, EarlyTable | None] = {}
        self.max_text_chars = None if max_length is None else max_length * CHARS_PER_TOKEN
        self._padding = "max_length" if pad_to_max_length else True
        self._lowercase = lowercase
        super().__init__(probe, cfg, device, model,
                         images=None if image_processor is None else plan_image_input(image_processor),
                         text=tokenizer is not None, default_normalize=default_normalize, pooling=pooling,
                         max_length=max_length, unavailable=unavailable, audio=audio)

    def text_pretokenizer(self, other_thread: bool) -> Callable[[Sequence[str]], TokenizedTexts] | None:
        """`pretokenize`; on a copy of the tokenizer for `other_thread` (a fast tokenizer's
        truncation and padding are set on it at every call, so the thread that pads batches and
        another that tokenizes must not share one)."""
        if "text" not in self.modalities:
            return None
        if not other_thread:
            return self.pretokenize
        return functools.partial(self.pretokenize, tokenizer=copy.deepcopy(self._tokenizer))

    # -- inputs

    def pretokenize(self, texts: Sequence[str], tokenizer: Any = None) -> TokenizedTexts:
        """Tokenize texts without padding (truncated at `max_length`), a few thousand per call.

        The pipeline sorts a window of texts by these token counts before cutting it into
        batches, and `encode` then only pads: bucketing by tokens instead of characters leaves
        ~1.04x the real tokens in the batches instead of ~1.13x (benchmark corpus, windows of 4096).
        A fast tokenizer's batch calls run on every core (`_tokenize_pool`), and only its ids are
        kept, as flat arrays (`TokenizedTexts`).
        """
        tokenizer = self._tokenizer if tokenizer is None else tokenizer
        texts = [t.lower() for t in texts] if self._lowercase else list(texts)
        chunks = [texts[a:a + PRETOKENIZE_CHUNK] for a in range(0, len(texts), PRETOKENIZE_CHUNK)]
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is None or self.max_length is None or not texts:
            parts = [self._tokenize_lists(part, tokenizer) for part in chunks]
        else:
            # one call through the tokenizer sets its backend's truncation (and no padding) exactly
            # as every call would; the backend's batch calls then keep those settings
            tokenizer(texts[:1], padding=False, truncation=True, max_length=self.max_length)
            keys = ["input_ids"] + (["token_type_ids"] if "token_type_ids" in tokenizer.model_input_names else [])

            # without character offsets where the tokenizers library offers it (~15% less work)
            batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch

            def encode(part: list[str]) -> TokenizedTexts:
                return TokenizedTexts.from_lists(*features_of(batch(part), keys, self.max_length))

            missing, found = self._early_split(backend, keys, texts)
            if found is not None:  # tokenized while the model loaded: only the others now
                rest = [texts[i] for i in missing]
                chunks = [rest[a:a + PRETOKENIZE_CHUNK] for a in range(0, len(rest), PRETOKENIZE_CHUNK)]
            pool = _tokenize_pool() if len(chunks) > 1 else None
            parts = list(pool.map(encode, chunks) if pool is not None else map(encode, chunks))
            if found is not None:
                return merge(len(texts), missing, found, TokenizedTexts.concat(parts) if parts else None)
        return TokenizedTexts.concat(parts) if parts else TokenizedTexts.from_lists({"input_ids": []}, [])

    def use_early_tokens(self, early: EarlySource) -> bool:
        """Look texts up in `early` before tokenizing them (`early_table.py`), where texts go
        through a fast tokenizer's backend with a length limit."""
        usable = "text" in self.modalities and self.max_length is not None and getattr(self._tokenizer, "is_fast", False)
        self._early = early if usable else None
        return bool(usable)

    def _early_split(self, backend: Any, keys: list[str], texts: list[str]) -> tuple[list[int], TokenizedTexts | None]:
        """(positions of the texts to tokenize now, the tokens of the others) from the early
        tokens where the tokenizer is theirs; ([], None) without them. A window with none of
        them releases them: the child tokenized the manifests' first texts, in order."""
        early = self._early
        if early is None:
            return [], None
        if getattr(backend, "encode_special_tokens", False):  # split_special_tokens: not in its JSON
            table = None
        elif id(backend) not in self._early_tables:  # each thread's tokenizer copy is compared once
            table = self._early_tables[id(backend)] = early.table(backend.to_str(), keys, self.max_length)
        else:
            table = self._early_tables[id(backend)]
        missing, found = table.split(texts) if table is not None else ([], None)
        if found is None:
            self._early, self._early_tables = None, {}
            early.release()
        return missing, found

    def _tokenize_lists(self, texts: list[str], tokenizer: Any) -> TokenizedTexts:
        """Texts through the tokenizer's own call (any tokenizer), kept as flat arrays."""
        enc = tokenizer(texts, padding=False, truncation=True, max_length=self.max_length,
                        return_attention_mask=False)
        truncated = self._truncated(texts, enc, tokenizer)
        return TokenizedTexts.from_lists({k: enc[k] for k in enc.keys() if k != "attention_mask"}, truncated)

    def _truncated(self, texts: Sequence[str], enc: Any, tokenizer: Any = None) -> list[bool]:
        encodings = getattr(enc, "encodings", None)
        if encodings:  # fast tokenizers record the cut-off tail: no second pass needed
            return [bool(e.overflowing) for e in encodings]
        full = (tokenizer or self._tokenizer)(texts, truncation=False, padding=False)["input_ids"]
        return [len(ids) > self.max_length for ids in full]

    def _pad_spec(self) -> PadSpec | None:
        """How the tokenizer pads, for numpy to pad as it does; None when it has no pad token
        (its own `pad` then says why it cannot)."""
        tok = self._tokenizer
        if tok.pad_token_id is None:
            return None
        return PadSpec(int(tok.pad_token_id), int(tok.pad_token_type_id), tok.padding_side,
                       self.max_length if self._padding == "max_length" else None,
                       "attention_mask" in tok.model_input_names)

    def _pad(self, items: Sequence["TokenizedText"] | TokenizedTexts) -> tuple[Inputs, list[bool]]:
        """Pad pretokenized texts exactly as the tokenizer pads when it tokenizes (side, ids, mask)."""
        import torch

        spec = self._pad_spec()
        if isinstance(items, TokenizedTexts) and spec is not None and set(items.features) <= {"input_ids",
                                                                                             "token_type_ids"}:
            arrays, truncated = items.padded(spec), items.truncated.tolist()
        else:
            arrays, truncated = self._pad_lists(items), [it.truncated for it in items]
        return {k: to_device(torch.from_numpy(np.ascontiguousarray(v)), self.device) for k, v in arrays.items()}, truncated

    def _pad_lists(self, items: Sequence["TokenizedText"]) -> dict[str, np.ndarray]:
        """Pad through the tokenizer's own `pad`."""
        # the tokenizer warns that __call__ is faster than encode-then-pad: not when the pad is
        # all that is left to do
        warned = getattr(self._tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["Asking-to-pad-a-fast-tokenizer"] = True
        features = {k: [it.features[k] for it in items] for k in items[0].features}
        limit = {"max_length": self.max_length} if self._padding == "max_length" else {}
        return dict(self._tokenizer.pad(features, padding=self._padding, return_tensors="np", **limit))

    def tokenize(self, texts: Sequence[Any] | TokenizedTexts) -> tuple[Inputs, list[bool]]:
        """Tokenize with truncation at `max_length`; also say which texts lost tokens.

        `texts` are strings, or `TokenizedText`s from `pretokenize` (then only padded), or a
        `TokenizedTexts` batch (padded by numpy)."""
        import torch

        if isinstance(texts, TokenizedTexts):
            return self._pad(texts)
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
