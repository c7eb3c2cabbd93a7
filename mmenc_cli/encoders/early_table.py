"""Tokens computed ahead of the run (by `run/early_tokens.py`'s child while the model loads),
looked up by the encoder: a text's tokens are found by the exact string the encoder would
tokenize, and only where they fit in the model's length (they were computed without truncation).
What is not found is tokenized as always, so what is encoded never depends on this table.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

from .tokens import TokenizedTexts


class EarlySource(Protocol):
    """Where an encoder gets early tokens: the table for its tokenizer, or None if they were made
    by another one (`tokenizer_json`: the loaded fast tokenizer's backend `to_str()`); `release`
    when it needs no more."""

    def table(self, tokenizer_json: str, keys: Sequence[str], max_length: int) -> "EarlyTable | None": ...

    def release(self) -> None: ...


class EarlyTable:
    """The child's texts and tokens: each text's tokens by the exact string; only texts whose
    tokens fit in `max_length` are kept (truncation would have cut the others)."""

    def __init__(self, frames: list[dict[str, Any]], keys: Sequence[str], max_length: int) -> None:
        parts, texts = [], []
        for f in frames:  # frame by frame: what is dropped is never copied
            part = TokenizedTexts({k: f[k] for k in keys}, f["starts"], np.zeros(len(f["texts"]), dtype=bool))
            keep = np.flatnonzero(part.lengths <= max_length)
            parts.append(part.take(keep))  # int32 while held
            texts += [f["texts"][i] for i in keep.tolist()]
            f.clear()
        self.tokens = TokenizedTexts.concat(parts)
        self.index: dict[str, int] = {}
        for at, text in enumerate(texts):
            self.index.setdefault(text, at)

    def split(self, texts: Sequence[str]) -> tuple[list[int], TokenizedTexts | None]:
        """(positions in `texts` of the texts without tokens here, the tokens of the others in
        order): a text is found when the child tokenized that exact string (within the length)."""
        get = self.index.get
        missing: list[int] = []
        at: list[int] = []
        for pos, text in enumerate(texts):
            i = get(text)
            if i is None:
                missing.append(pos)
            else:
                at.append(i)
        if not at:
            return missing, None
        found_tokens = self.tokens.take(np.asarray(at, dtype=np.int64))
        return missing, TokenizedTexts({k: v.astype(np.int64) for k, v in found_tokens.features.items()},
                                       found_tokens.starts, found_tokens.truncated)


def merge(n: int, missing: list[int], found: TokenizedTexts | None,
          tokenized: TokenizedTexts | None) -> TokenizedTexts:
    """`n` texts' tokens in order, from those found early (every position not in `missing`, in
    order) and those tokenized now (the `missing` positions, in order)."""
    if found is None or tokenized is None:
        result = found if tokenized is None else tokenized
        assert result is not None and len(result) == n
        return result
    where = np.ones(n, dtype=bool)
    where[missing] = False
    positions = np.concatenate([np.flatnonzero(where), np.asarray(missing, dtype=np.int64)])
    return TokenizedTexts.concat([found, tokenized]).take(np.argsort(positions, kind="stable"))
