"""Tokenized texts as flat numpy arrays: a window's token ids one text after another, with the
offsets of each text, padded into a batch by numpy exactly as the tokenizer pads.

A window of 16,384 texts kept as Python lists (one dict and a few lists a text) costs more to
build, sort and pad than tokenizing it: here a window is a few arrays, sorted with one gather,
and a batch is a contiguous slice padded with one masked assignment. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, Sequence, overload

import numpy as np


@dataclass(slots=True)
class TokenizedText:
    """One text tokenized without padding: the tokenizer's per-text features (input_ids, and
    token_type_ids where the model has them) and whether truncation cut it."""

    features: dict[str, list[int]]
    truncated: bool

    def __len__(self) -> int:
        return len(self.features["input_ids"])


@dataclass(frozen=True, slots=True)
class PadSpec:
    """How the tokenizer pads a batch: pad ids, the side, a fixed length (None: the longest text)
    and whether it adds an attention mask."""

    pad_id: int
    pad_type_id: int = 0
    side: str = "right"
    length: int | None = None
    attention_mask: bool = True


@dataclass(slots=True)
class TokenizedTexts:
    """Texts tokenized without padding: each feature's ids of all texts in one flat int64 array,
    text i at `starts[i]:starts[i + 1]`; `truncated[i]` says whether truncation cut text i.

    A sequence of texts: `len` counts texts, a slice is a view of contiguous texts, an index gives
    one `TokenizedText`.
    """

    features: dict[str, np.ndarray]
    starts: np.ndarray
    truncated: np.ndarray

    @classmethod
    def from_lists(cls, features: dict[str, Sequence[Sequence[int]]], truncated: Sequence[bool]) -> "TokenizedTexts":
        """From per-text lists of ids (what a tokenizer returns), one list per feature."""
        first = next(iter(features.values()))
        starts = np.zeros(len(first) + 1, dtype=np.int64)
        np.cumsum([len(ids) for ids in first], out=starts[1:])
        flat = {k: np.fromiter(chain.from_iterable(v), dtype=np.int64, count=int(starts[-1]))
                for k, v in features.items()}
        return cls(flat, starts, np.asarray(truncated, dtype=bool).reshape(len(first)))

    @classmethod
    def concat(cls, parts: Sequence["TokenizedTexts"]) -> "TokenizedTexts":
        """The texts of `parts`, one after another."""
        parts = [p for p in parts if len(p)] or list(parts[:1])
        if len(parts) == 1:
            return parts[0]
        offsets = np.cumsum([0] + [int(p.starts[-1] - p.starts[0]) for p in parts[:-1]])
        starts = np.concatenate([parts[0].starts[:1] - parts[0].starts[0]]
                                + [p.starts[1:] - p.starts[0] + off for p, off in zip(parts, offsets)])
        features = {k: np.concatenate([p.features[k][p.starts[0]:p.starts[-1]] for p in parts])
                    for k in parts[0].features}
        return cls(features, starts, np.concatenate([p.truncated for p in parts]))

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Each text's token count."""
        return np.diff(self.starts)

    @overload
    def __getitem__(self, key: int) -> TokenizedText: ...

    @overload
    def __getitem__(self, key: slice) -> "TokenizedTexts": ...

    def __getitem__(self, key: int | slice) -> "TokenizedText | TokenizedTexts":
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                return self.take(np.arange(a, b, step))
            b = max(a, b)
            return TokenizedTexts(self.features, self.starts[a:b + 1], self.truncated[a:b])
        i = range(len(self))[key]
        a, b = int(self.starts[i]), int(self.starts[i + 1])
        return TokenizedText({k: v[a:b].tolist() for k, v in self.features.items()}, bool(self.truncated[i]))

    def take(self, order: np.ndarray) -> "TokenizedTexts":
        """The texts at `order`, in that order, as new compact arrays (one gather per feature)."""
        order = np.asarray(order, dtype=np.int64)
        lengths = self.lengths[order]
        starts = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        # flat position j of new text r comes from old position starts_old[order[r]] + (j - starts[r])
        index = np.repeat(self.starts[:-1][order] - starts[:-1], lengths) + np.arange(starts[-1], dtype=np.int64)
        return TokenizedTexts({k: v[index] for k, v in self.features.items()}, starts, self.truncated[order])

    def padded(self, spec: PadSpec) -> dict[str, np.ndarray]:
        """The batch as the tokenizer pads it: [n, longest] (or [n, spec.length]) int64 arrays,
        `pad_id` / `pad_type_id` in the padding, an attention mask of ones over the tokens."""
        lengths = self.lengths
        width = int(lengths.max(initial=0)) if spec.length is None else max(spec.length, int(lengths.max(initial=0)))
        columns = np.arange(width)
        if spec.side == "left":
            mask = columns >= (width - lengths)[:, None]
        else:
            mask = columns < lengths[:, None]
        out: dict[str, np.ndarray] = {}
        a, b = int(self.starts[0]), int(self.starts[-1])
        for key, flat in self.features.items():
            arr = np.full(mask.shape, spec.pad_type_id if key == "token_type_ids" else spec.pad_id, dtype=np.int64)
            arr[mask] = flat[a:b]  # row-major: each row's tokens in order, rows one after another
            out[key] = arr
        if spec.attention_mask:
            out["attention_mask"] = mask.astype(np.int64)
        return out


def features_of(encodings: Sequence[Any], keys: Sequence[str],
                limit: int) -> tuple[dict[str, list[list[int]]], list[bool]]:
    """Per-text ids of a fast tokenizer's `Encoding`s (`ids`, `type_ids`) and their truncation
    flags (only a text at the `limit` can have been cut: only its overflow is looked at)."""
    attr = {"input_ids": "ids", "token_type_ids": "type_ids"}
    features = {k: [getattr(e, attr[k]) for e in encodings] for k in keys}
    lengths = [len(ids) for ids in features["input_ids"]]
    return features, [n >= limit and bool(e.overflowing) for n, e in zip(lengths, encodings)]
