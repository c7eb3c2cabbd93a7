"""The shared body of the transformers-backed adapters (`HFEncoder`).

`HFEncoder` owns what every transformers family needs: the model on its device and dtype,
tokenizing with honest truncation flags (and pretokenizing windows of texts so batches only pad),
turning worker `ImageInput`s into a device batch, `torch.compile` with an eager fallback, and a
one-item probe at load time that fixes `dim` and fails fast. How a batch's forward runs (one
stream, or the CPU's two streams with oneDNN's linears) is the `forward` object of `cpu/`; a
family subclass (`clip.py`, `vision.py`, `sentence.py`) only says how inputs become vectors
(`_embed_image` / `_embed_text`).
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import ModelLoadError, first_line
from .base import EncodeOutput, Encoder, ImageInput, ImagePreprocessor
from .cpu import make_forward
from .device import to_device
from .forward import CompiledOrEager, Inputs
from .loading import ModelProbe
from .preprocess import plan_image_input

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


class HFEncoder(Encoder):
    """Shared body of the transformers-backed adapters.

    Subclasses set `family` and `towers` (the modalities they embed) and implement
    `_embed_image(inputs)` and/or `_embed_text(inputs)` returning `[n, dim]` tensors; a modality
    is offered when its tower exists and its processor/tokenizer loaded.
    """

    family = "hf"
    towers: frozenset[str] = frozenset()

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 tokenizer: Any = None, image_processor: Any = None, max_length: int | None = None,
                 pad_to_max_length: bool = False, lowercase: bool = False, default_normalize: bool,
                 pooling: str, unavailable: dict[str, str] | None = None) -> None:
        self.model, self.device = model, device
        self.dtype = next(model.parameters()).dtype
        self.forward = make_forward(cfg.cpu_forward, model, device, cfg.compile)
        self.default_normalize = default_normalize
        self._tokenizer, self.max_length = tokenizer, max_length
        self.max_text_chars = None if max_length is None else max_length * CHARS_PER_TOKEN
        self._padding = "max_length" if pad_to_max_length else True
        self._lowercase = lowercase
        self._prep: ImagePreprocessor | None = None
        self._table = None
        if image_processor is not None:
            self._plan_images(image_processor)
        offered = {"image": self._prep is not None, "text": tokenizer is not None}
        self.modalities = frozenset(m for m in self.towers if offered[m])
        if not self.modalities:
            reasons = "; ".join((unavailable or {}).values())
            raise ModelLoadError(f"{probe.source}: no usable modality ({reasons})")
        self.info: dict[str, Any] = self._facts(probe, cfg, pooling, unavailable)
        self._run: dict[str, Callable[[Inputs], "torch.Tensor"]] = {
            m: getattr(self, f"_embed_{m}") for m in self.modalities}
        self.dim = self._probe_dim()
        if cfg.compile:
            self._run = {m: CompiledOrEager(fn, f"{self.family} {m}") for m, fn in self._run.items()}

    def _plan_images(self, image_processor: Any) -> None:
        """The worker-side preprocessor and, on the uint8 path, the normalization table."""
        import torch

        self._prep, table = plan_image_input(image_processor)
        if table is not None:
            self._table_np = table  # [3, 256] float32, for the CPU path
            self._table = torch.from_numpy(table).reshape(-1).to(self.device)
            self._offsets = (torch.arange(3, dtype=torch.int32, device=self.device) * 256).view(1, 3, 1, 1)

    def _facts(self, probe: ModelProbe, cfg: "ModelConfig", pooling: str,
               unavailable: dict[str, str] | None) -> dict[str, Any]:
        """What the run metadata records about this model and how it runs."""
        path = self.forward.summary()
        return {
            "model": cfg.model, "revision": cfg.revision, "commit": probe.commit, "family": self.family,
            "model_type": probe.model_type, "pooling": pooling, "max_length": self.max_length,
            "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
            "image_input": None if self._prep is None else "uint8" if self._table is not None else "float32",
            "default_normalize": self.default_normalize, "compile": cfg.compile,
            "cpu_linear": _cpu_linear(path), "cpu_streams": path["streams"],
            "unavailable": dict(unavailable or {}),
        }

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        raise NotImplementedError

    def _embed_text(self, inputs: Inputs) -> "torch.Tensor":
        raise NotImplementedError

    # -- Encoder

    def image_preprocessor(self) -> ImagePreprocessor:
        """The picklable worker-side preprocessor (torch-free on the uint8 path)."""
        if self._prep is None:
            raise ValueError(f"{self.info['model']}: this model does not encode images")
        return self._prep

    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        """Encode images (`ImageInput`s) or texts; float32 vectors, left on the device."""
        if modality not in self.modalities:
            raise ValueError(f"this model does not encode {modality!r}")
        vectors, truncated = self.forward.run(payloads, functools.partial(self._inputs, modality),
                                              self._run[modality])
        return EncodeOutput(vectors, truncated)

    def text_pretokenizer(self, other_thread: bool) -> Callable[[Sequence[str]], list["TokenizedText"]] | None:
        """`pretokenize`; on a copy of the tokenizer for `other_thread` (a fast tokenizer's
        truncation and padding are set on it at every call, so the thread that pads batches and
        another that tokenizes must not share one)."""
        if "text" not in self.modalities:
            return None
        if not other_thread:
            return self.pretokenize
        return functools.partial(self.pretokenize, tokenizer=copy.deepcopy(self._tokenizer))

    def device_seconds(self) -> float | None:
        """Seconds the accelerator spent in forward passes so far (CUDA events), None on the CPU."""
        return self.forward.device_seconds()

    def forward_summary(self) -> dict[str, Any] | None:
        """How the forward ran: `--cpu-forward` asked, streams, linears, the probes' evidence."""
        return self.forward.summary()

    def _inputs(self, modality: str, payloads: Sequence[Any]) -> tuple[Inputs, list[bool]]:
        if modality == "image":
            return self.collate_images(payloads), []
        return self.tokenize(payloads)

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

    def collate_images(self, items: Sequence[ImageInput]) -> Inputs:
        """Stack worker outputs into a device batch; uint8 pixels become normalized floats here."""
        import torch

        stacked = np.stack([it.pixels for it in items])
        if stacked.dtype == np.uint8 and self.device == "cpu" and stacked.ndim == 4 and stacked.shape[1] == 3:
            # exact: the table holds the processor's own float32 result for each (channel, value);
            # numpy's take on uint8 indices is ~3x faster than an int32 gather in torch on the CPU
            out = np.empty(stacked.shape, dtype=np.float32)
            for c in range(3):
                np.take(self._table_np[c], stacked[:, c], out=out[:, c], mode="clip")
            pixels = torch.from_numpy(out)
        else:
            # on an accelerator the compact uint8 batch crosses the bus and is normalized there
            pixels = to_device(torch.from_numpy(stacked), self.device)
            if pixels.dtype == torch.uint8:
                pixels = self._table[pixels.int() + self._offsets]
        inputs = {"pixel_values": pixels.to(self.dtype)}
        for key in items[0].meta.get("inputs", {}):
            inputs[key] = to_device(torch.from_numpy(np.stack([it.meta["inputs"][key] for it in items])),
                                    self.device)
        return inputs

    def _probe_dim(self) -> int:
        """Encode one dummy item per modality: fixes `dim` and fails at startup, not at batch one."""
        from PIL import Image

        dims = {}
        for modality in sorted(self.modalities):
            dummy = self._prep(Image.new("RGB", (48, 40), (120, 90, 60))) if modality == "image" else "mmenc"
            try:
                vectors = self.encode(modality, [dummy]).vectors
            except ModelLoadError:
                raise
            except Exception as exc:
                raise ModelLoadError(f"{self.info['model']}: a test {modality} encode failed: "
                                     f"{type(exc).__name__}: {first_line(exc)}") from exc
            if vectors.ndim != 2 or vectors.shape[0] != 1:
                raise ModelLoadError(f"{self.info['model']}: {modality} output has shape "
                                     f"{tuple(vectors.shape)}, expected (1, dim)")
            dims[modality] = int(vectors.shape[1])
        if len(set(dims.values())) > 1:
            raise ModelLoadError(f"{self.info['model']}: image and text dimensions differ: {dims}")
        return next(iter(dims.values()))


def pooled(output: Any) -> "torch.Tensor":
    """`get_*_features` returns a tensor in transformers 4 and a model output in 5 (projected
    embeddings in `pooler_output`)."""
    import torch

    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _cpu_linear(path: dict[str, Any]) -> str | None:
    """The run metadata's `cpu_linear`: None (PyTorch's own), "onednn" (pinned) or "auto"."""
    if path["evidence"] is None:
        return None
    return "onednn" if path["mode"] == "onednn" else "auto"
