"""The pipeline with a fake encoder: accounting, isolation, bisection, OOM back-off, resume."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmenc_cli.config import BatchConfig, RunConfig
from mmenc_cli.errors import OutputError
from mmenc_cli.output import OutDir
from mmenc_cli.run import texts as run_texts
from mmenc_cli.run.pipeline import run_encode
from tests.conftest import make_image, write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import embeddings, error_rows, make_cfg
from tests.faults import build_fault_corpus, build_good_corpus


def test_fault_corpus_every_item_accounted_and_good_items_match_clean_run(tmp_path: Path) -> None:
    faults = build_fault_corpus(tmp_path / "media")
    good = build_good_corpus(tmp_path / "media")
    good_rows = [{"id": f"good-{k}", "image": v, "text": f"caption {k}"} for k, v in good.items()]
    fault_rows = [{"id": f"bad-{k}", "image": case.source, "text": f"caption of {k}"} for k, case in faults.items()]
    invalid = ["{not json", json.dumps({"image": "x.png"}), json.dumps({"id": 3.5, "text": "t"}),
               json.dumps({"id": "no-content"}), json.dumps({"id": "good-cmyk_jpeg", "text": "repeat"}),
               json.dumps({"id": "empty-text", "text": "  "})]
    rows: list[Any] = []
    for i in range(max(len(good_rows), len(fault_rows))):  # interleave so bad items share batches with good
        rows += good_rows[i:i + 1] + fault_rows[i:i + 1]
    rows += invalid
    manifest = write_jsonl(tmp_path / "media" / "m.jsonl", rows)
    out = tmp_path / "out"
    result = run_encode(make_cfg([manifest], out, batch_size=4), encoder_factory=factory(FakeEncoder()))

    c = result.counters
    assert c.balanced
    errs = error_rows(out)
    got = embeddings(out)
    # every requested item in exactly one place
    for r in good_rows + fault_rows:
        for mod in ("image", "text"):
            in_out = (r["id"], mod) in got
            in_err = sum(1 for e in errs if e["id"] == r["id"] and e["modality"] == mod)
            assert in_out + in_err == 1, (r["id"], mod, in_out, in_err)
    # each fault has its code and reason
    by_id = {e["id"]: e for e in errs if e["modality"] == "image"}
    for k, case in faults.items():
        e = by_id[f"bad-{k}"]
        assert (e["code"], e["reason"]) == (case.code, case.reason), k
        assert e["manifest"] == str(manifest) and e["line"] and e["offset"] is not None
    invalid_errs = [e for e in errs if e["modality"] is None]
    assert sorted(e["reason"] for e in invalid_errs) == sorted(
        ["manifest.invalid_json", "manifest.missing_id", "manifest.invalid_type", "manifest.empty_row",
         "manifest.duplicate_id"])
    assert [e["code"] for e in errs if e["id"] == "empty-text"] == [422]
    # good items equal their vectors from a clean run of only the good rows
    clean = tmp_path / "clean"
    run_encode(make_cfg([write_jsonl(tmp_path / "media" / "g.jsonl", good_rows)], clean),
               encoder_factory=factory(FakeEncoder()))
    ref = embeddings(clean)
    assert set(ref) <= set(got)
    for key, vec in ref.items():
        np.testing.assert_array_equal(got[key], vec)


def test_bisection_fails_only_the_guilty_item(tmp_path: Path, small_manifest: Path) -> None:
    enc = FakeEncoder(fail_on=lambda m, p: m == "text" and "thing 4" in p)
    result = run_encode(make_cfg([small_manifest], tmp_path / "out", batch_size=8), encoder_factory=factory(enc))
    errs = error_rows(tmp_path / "out")
    assert [(e["id"], e["modality"], e["code"], e["reason"]) for e in errs] == [("r4", "text", 500, "encode.failed")]
    assert "fake encoder failure" in errs[0]["message"] and errs[0]["error"] == "ValueError"
    assert result.counters.mod("text").encoded == result.counters.mod("text").requested - 1


def test_output_count_mismatch_is_bisected(tmp_path: Path, small_manifest: Path) -> None:
    # a "batch" that returns one output too few whenever it holds r5's text: only r5 fails
    enc = FakeEncoder(drop_output=lambda m, ps: m == "text" and any("thing 5" in p for p in ps))
    run_encode(make_cfg([small_manifest], tmp_path / "out", batch_size=8), encoder_factory=factory(enc))
    errs = error_rows(tmp_path / "out")
    assert [(e["id"], e["reason"], e["code"]) for e in errs] == [("r5", "encode.output_count", 500)]
    assert len(embeddings(tmp_path / "out")) == 8 + 8 - 1


def test_non_finite_vector_is_that_items_failure(tmp_path: Path, small_manifest: Path) -> None:
    enc = FakeEncoder(nan_on=lambda m, p: m == "text" and "thing 7" in p)
    run_encode(make_cfg([small_manifest], tmp_path / "out"), encoder_factory=factory(enc))
    errs = error_rows(tmp_path / "out")
    assert [(e["id"], e["reason"]) for e in errs] == [("r7", "encode.non_finite")]
    assert ("r7", "text") not in embeddings(tmp_path / "out")


def test_oom_from_batch_size_alone_halves_and_grows_back_without_errors(tmp_path: Path, caplog: Any) -> None:
    rows = [{"id": f"t{i}", "text": f"text number {i}"} for i in range(200)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    enc = FakeEncoder(oom_above=4)
    cfg = make_cfg([manifest], tmp_path / "out", batch_size=16)
    cfg_batch = BatchConfig(batch_size=16, workers=0, grow_after=3)
    cfg = RunConfig(**{**cfg.__dict__, "batch": cfg_batch})
    with caplog.at_level(logging.WARNING, logger="mmenc"):
        result = run_encode(cfg, encoder_factory=factory(enc))
    assert error_rows(tmp_path / "out") == []
    assert result.counters.mod("text").encoded == 200
    text = caplog.text
    assert "halving to 8" in text and "halving to 4" in text
    assert "growing batch size 4 -> 8" in text
    # every batch that succeeded had at most 4 items
    sizes = [n for m, n in enc.batches]
    assert max(sizes) == 16 and sum(n for n in sizes if n <= 4) == 200


def test_oom_of_one_item_gives_exactly_one_507(tmp_path: Path, small_manifest: Path) -> None:
    enc = FakeEncoder(oom_on=lambda m, p: m == "text" and "thing 8" in p)
    result = run_encode(make_cfg([small_manifest], tmp_path / "out", batch_size=8), encoder_factory=factory(enc))
    errs = error_rows(tmp_path / "out")
    assert [(e["id"], e["modality"], e["code"], e["reason"]) for e in errs] == [("r8", "text", 507, "encode.out_of_memory")]
    assert result.counters.balanced


def test_rerun_of_finished_run_does_not_load_model_and_appends_encode_only_new(tmp_path: Path, small_manifest: Path) -> None:
    out = tmp_path / "out"
    first = run_encode(make_cfg([small_manifest], out), encoder_factory=factory(FakeEncoder()))
    assert first.model_loaded
    before = embeddings(out)

    def no_load(*a: Any, **k: Any) -> Any:
        raise AssertionError("the model must not load on a finished re-run")

    again = run_encode(make_cfg([small_manifest], out), encoder_factory=no_load)
    assert not again.model_loaded and again.state == "done"
    assert again.counters.encoded == first.counters.encoded
    # nightly cron: append rows, re-run: only the new rows are encoded
    with open(small_manifest, "a") as fh:
        fh.write(json.dumps({"id": "new-1", "text": "fresh text"}) + "\n")
    enc = FakeEncoder()
    third = run_encode(make_cfg([small_manifest], out), encoder_factory=factory(enc))
    assert enc.batches == [("text", 1)]
    assert third.counters.mod("text").encoded == 1
    after = embeddings(out)
    assert set(after) == set(before) | {("new-1", "text")}


def test_fingerprint_mismatch_refuses_and_overwrite_starts_over(tmp_path: Path, small_manifest: Path) -> None:
    out = tmp_path / "out"
    run_encode(make_cfg([small_manifest], out), encoder_factory=factory(FakeEncoder()))
    with pytest.raises(OutputError, match="text_prefix"):
        run_encode(make_cfg([small_manifest], out, text_prefix="query: "), encoder_factory=factory(FakeEncoder()))
    res = run_encode(make_cfg([small_manifest], out, text_prefix="query: ", overwrite=True),
                     encoder_factory=factory(FakeEncoder()))
    assert res.counters.mod("text").encoded == 8 and res.counters.mod("text").encoded_before == 0


def test_resume_refuses_a_hub_model_whose_commit_moved(tmp_path: Path, small_manifest: Path) -> None:
    """Same options (so the same fingerprint), but the hub id now resolves to another commit."""
    out = tmp_path / "out"

    def hub(commit: str) -> FakeEncoder:
        return FakeEncoder(info={"family": "fake", "revision": None, "commit": commit})

    run_encode(make_cfg([small_manifest], out, limit=4), encoder_factory=factory(hub("aaa111")))
    before = embeddings(out)
    with pytest.raises(OutputError, match="commit bbb222.*commit aaa111"):
        run_encode(make_cfg([small_manifest], out), encoder_factory=factory(hub("bbb222")))
    assert embeddings(out).keys() == before.keys()  # nothing written by the refused run
    res = run_encode(make_cfg([small_manifest], out), encoder_factory=factory(hub("aaa111")))
    assert res.counters.mod("text").encoded_before > 0 and res.counters.mod("text").encoded > 0


def test_skipped_rows_kept_fields_and_limit(tmp_path: Path) -> None:
    rows = [{"id": "a", "text": "only text", "label": 1}, {"id": "b", "image": make_image(tmp_path / "b.png").name,
                                                             "label": {"k": [1, 2]}},
            {"id": "c", "text": "more", "label": "x"}]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    res = run_encode(make_cfg([manifest], tmp_path / "out", keep=["label"], modalities=("image",)),
                     encoder_factory=factory(FakeEncoder()))
    assert res.counters.mod("image").skipped == 2 and res.counters.rows_skipped == 2
    assert res.counters.mod("image").encoded == 1 and "text" not in res.counters.modalities
    import pyarrow.parquet as pq

    table = pq.read_table(next(iter(OutDir(tmp_path / "out").shards())))
    assert table.column("label").to_pylist() == ['{"k": [1, 2]}']
    res2 = run_encode(make_cfg([manifest], tmp_path / "out2", limit=2), encoder_factory=factory(FakeEncoder()))
    assert res2.counters.rows == 2


def test_fail_fast_and_thresholds(tmp_path: Path, small_manifest: Path) -> None:
    with open(small_manifest, "a") as fh:
        fh.write("broken\n")
    res = run_encode(make_cfg([small_manifest], tmp_path / "a", max_errors=0), encoder_factory=factory(FakeEncoder()))
    assert res.state == "done" and res.threshold_exceeded and "max-errors" in res.threshold_exceeded
    assert res.counters.encoded == 16  # the threshold does not stop the run
    res = run_encode(make_cfg([small_manifest], tmp_path / "b", max_error_rate=0.5), encoder_factory=factory(FakeEncoder()))
    assert res.threshold_exceeded is None
    res = run_encode(make_cfg([small_manifest], tmp_path / "c", fail_fast=True), encoder_factory=factory(FakeEncoder()))
    assert res.state == "stopped"


def test_workers_give_the_same_vectors_as_in_process(tmp_path: Path, small_manifest: Path) -> None:
    run_encode(make_cfg([small_manifest], tmp_path / "w0", workers=0), encoder_factory=factory(FakeEncoder()))
    run_encode(make_cfg([small_manifest], tmp_path / "w2", workers=2), encoder_factory=factory(FakeEncoder()))
    a, b = embeddings(tmp_path / "w0"), embeddings(tmp_path / "w2")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_safetensors_format_round_trip(tmp_path: Path, small_manifest: Path) -> None:
    run_encode(make_cfg([small_manifest], tmp_path / "p"), encoder_factory=factory(FakeEncoder()))
    run_encode(make_cfg([small_manifest], tmp_path / "s", format="safetensors"), encoder_factory=factory(FakeEncoder()))
    a, b = embeddings(tmp_path / "p"), embeddings(tmp_path / "s")
    assert a.keys() == b.keys() and len(a) == 16
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_parquet_inline_bytes_csv_and_jsonl_in_one_run(tmp_path: Path) -> None:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    def png(seed: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.full((10, 12, 3), seed * 20, np.uint8)).save(buf, format="PNG")
        return buf.getvalue()

    pq.write_table(pa.table({"id": [1, 2], "image": [{"bytes": png(1), "path": "a.png"}, {"bytes": png(2), "path": None}],
                             "text": ["one", None]}), tmp_path / "hf.parquet")
    pq.write_table(pa.table({"id": ["b1"], "image": pa.array([png(3)], pa.binary())}), tmp_path / "bin.parquet")
    (tmp_path / "m.csv").write_text("id,image,text\nc1,,csv text\n")
    make_image(tmp_path / "j.png")
    write_jsonl(tmp_path / "m.jsonl", [{"id": "j1", "image": "j.png"}])
    manifests = [tmp_path / n for n in ("hf.parquet", "bin.parquet", "m.csv", "m.jsonl")]
    res = run_encode(make_cfg(manifests, tmp_path / "out"), encoder_factory=factory(FakeEncoder()))
    assert error_rows(tmp_path / "out") == [] and res.counters.balanced
    assert set(embeddings(tmp_path / "out")) == {("1", "image"), ("1", "text"), ("2", "image"), ("b1", "image"),
                                                 ("c1", "text"), ("j1", "image")}


def test_texts_are_bucketed_by_length_in_bounded_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts are sorted by length within windows of TEXT_WINDOW rows: batches pad little, no text
    is lost or repeated, and a window never holds more than TEXT_WINDOW + a batch."""
    import random

    monkeypatch.setattr(run_texts, "TEXT_WINDOW", 40)
    rng = random.Random(5)
    rows = [{"id": f"t{i}", "text": "w" * rng.randint(1, 300)} for i in range(203)]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)

    class Recording(FakeEncoder):
        def encode(self, modality, payloads):
            texts_seen.append(list(payloads))
            return super().encode(modality, payloads)

    texts_seen: list[list[str]] = []
    res = run_encode(make_cfg([manifest], tmp_path / "out", batch_size=4), encoder_factory=factory(Recording()))
    assert res.counters.mod("text").encoded == 203
    assert sorted(t for batch in texts_seen for t in batch) == sorted(r["text"] for r in rows)
    got = embeddings(tmp_path / "out")
    assert {i for i, _ in got} == {r["id"] for r in rows}
    padded = sum(max(map(len, b)) * len(b) for b in texts_seen)
    unsorted = sum(max(len(r["text"]) for r in rows[i:i + 4]) * len(rows[i:i + 4]) for i in range(0, 203, 4))
    assert padded < 0.75 * unsorted  # bucketing cut the padding (0.68 of manifest order, measured)
    # the first window is encoded once TEXT_WINDOW texts wait, not at the end
    first_window = sorted(len(r["text"]) for r in rows[:40])
    assert [len(t) for t in texts_seen[0]] == first_window[:4]
