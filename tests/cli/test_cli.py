"""The CLI through Typer's runner: the bundled samples end to end, inspect, errors, exit codes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.output.embeddings import read_embeddings
from tests.conftest import make_image, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def run(*args: object) -> "object":
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_samples_end_to_end_with_default_demo_model(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = run("encode", ROOT / "samples" / "manifest.jsonl", "--out", out, "--progress", "none")
    assert res.exit_code == 0, res.output
    # the demo-model warning and the summary, nothing else; nothing on stdout without --json
    lines = res.stderr.splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d mmenc WARNING: using the bundled DEMO model .*demo_model "
                        r"\(random weights, meaningless embeddings; pass --model for real ones\)", lines[0]), lines
    assert re.fullmatch(rf"mmenc: 23 rows -> {re.escape(str(out))} in \d+\.\d s: 28 items encoded, "
                        r"3 items failed, 7 rows have no image, 8 rows have no text",
                        lines[1]), lines
    assert lines[2:] == ["  image  14 encoded, 2 failed", "  text   14 encoded, 1 failed", "  400 bad input: 1",
                         "  404 not found: 1", "  422 unusable input: 1", f"  see: mmenc errors summary {out}"]
    assert res.stdout == ""
    ids, mat = read_embeddings(out, "image")
    assert len(ids) == 14 and mat.shape[1] > 0
    ids, mat = read_embeddings(out, "text")
    assert len(ids) == 14
    res = run("errors", "list", out, "--json")  # the samples' three failures, on the first try
    assert sorted((json.loads(line)["id"], json.loads(line)["reason"]) for line in res.stdout.splitlines()) == \
        [("sample-20", "media.not_found"), ("sample-21", "media.unreadable"), ("sample-22", "text.empty")]
    res = run("inspect", out, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["embeddings"] == 28 and report["by_modality"] == {"image": 14, "text": 14}
    assert report["dim"] == mat.shape[1] and "demo_model" in report["model"] and report["shards"]
    meta = json.loads((out / "_mmenc" / "tasks" / "task-00000.json").read_text())
    assert meta["versions"]["torch"] and meta["counters"]["balanced"] and meta["state"] == "done"
    run_meta = json.loads((out / "_mmenc" / "run.json").read_text())
    assert run_meta["facts"]["normalize"] is True and run_meta["config"]["model"]["model"]


def test_errors_summary_list_retry_then_resolved(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    make_image(data / "ok.png")
    rows = [{"id": "ok", "image": "ok.png", "text": "fine", "label": "keep-me"},
            {"id": "later", "image": "later.png", "text": "fine too", "label": "x"},
            "{broken json",
            {"id": "far", "image": "ftp://example.invalid/a.png"}]
    manifest = write_jsonl(data / "m.jsonl", rows)
    out = tmp_path / "out"
    res = run("encode", manifest, "--out", out, "--progress", "none", "--keep", "label", "--workers", "0")
    assert res.exit_code == 0, res.output
    res = run("errors", "summary", out, "--json")
    s = json.loads(res.stdout)
    assert s["errors"] == 3 and s["by_code"] == {"404": 1, "400": 1, "415": 1}
    assert s["by_reason"]["media.not_found"] == 1 and s["by_modality"] == {"image": 2, "none": 1}
    assert {"by_stage", "by_modality", "by_reason", "by_code"} <= set(s)
    res = run("errors", "list", out, "--json", "--code", "404")
    listed = [json.loads(l) for l in res.stdout.splitlines()]
    assert [r["id"] for r in listed] == ["later"] and listed[0]["line"] == 2 and listed[0]["offset"] > 0
    res = run("errors", "list", out, "--grep", "ftp")
    assert "far" in res.stdout and "later" not in res.stdout
    retry = tmp_path / "retry.jsonl"
    res = run("errors", "retry", out, "-o", retry, "--code", "404")
    assert res.exit_code == 0, res.output
    rows_back = [json.loads(l) for l in retry.read_text().splitlines()]
    assert rows_back == [{"id": "later", "image": str(data / "later.png"), "label": "x"}]  # image only: text succeeded
    make_image(data / "later.png", seed=3)  # the user fixes the input
    res = run("encode", retry, "--out", out, "--progress", "none", "--keep", "label", "--workers", "0")
    assert res.exit_code == 0, res.output
    ids, _ = read_embeddings(out, "image")
    assert sorted(ids) == ["later", "ok"]
    s = json.loads(run("errors", "summary", out, "--json").stdout)
    assert s["errors"] == 2 and "404" not in s["by_code"]  # resolved items no longer count
    ids, _ = read_embeddings(out, "text")
    assert sorted(ids) == ["later", "ok"]  # no text duplicated by the retry


@pytest.mark.parametrize("args,needle", [
    (["--pooling", "weird"], "--pooling"),
    (["--keep", "embedding"], "reserved"),
    (["--modality", "smell"], "--modality"),
    (["--batch-size", "0"], "--batch-size"),
])
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    res = run("encode", manifest, "--out", tmp_path / "o", *args)
    assert res.exit_code == 2 and needle in res.output


def test_missing_manifest_and_unloadable_model(tmp_path: Path) -> None:
    res = run("encode", tmp_path / "nope.jsonl", "--out", tmp_path / "o")
    assert res.exit_code == 2 and "does not exist" in res.output
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    res = run("encode", manifest, "--out", tmp_path / "o", "--model", tmp_path / "no-model", "--device", "cpu")
    assert res.exit_code == 3
    assert len([l for l in res.output.splitlines() if l.startswith("mmenc: error")]) == 1 and "Traceback" not in res.output


def test_text_only_model_refuses_image_modality(tmp_path: Path, tiny_st: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    res = run("encode", manifest, "--out", tmp_path / "o", "--model", tiny_st, "--modality", "image", "--device", "cpu")
    assert res.exit_code == 3 and "cannot encode image" in res.output
    res = run("encode", manifest, "--out", tmp_path / "o2", "--model", tiny_st, "--device", "cpu", "--progress", "none")
    assert res.exit_code == 0, res.output


def test_unwritable_output_exits_3(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    res = run("encode", manifest, "--out", blocker / "out", "--device", "cpu")
    assert res.exit_code == 3 and "not writable" in res.output


def test_inspect_missing_folder_fails(tmp_path: Path) -> None:
    res = run("inspect", tmp_path / "none")
    assert res.exit_code != 0


def test_threshold_exit_4(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}, "bad line"])
    res = run("encode", manifest, "--out", tmp_path / "o", "--max-errors", "0", "--device", "cpu", "--progress", "none")
    assert res.exit_code == 4 and "error threshold exceeded" in res.output
    assert read_embeddings(tmp_path / "o", "text")[0] == ["a"]  # still wrote everything


def test_plain_log_lines_when_not_a_terminal(tmp_path: Path) -> None:
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"text {i}"} for i in range(40)])
    res = run("encode", manifest, "--out", tmp_path / "o", "--device", "cpu", "--progress", "log", "--log-every", "0",
              "--batch-size", "4")
    assert res.exit_code == 0, res.output
    lines = [l for l in res.output.splitlines() if "progress: rows" in l]
    assert lines and "\r" not in res.output
