"""A run over a folder, tar shards and an img2dataset output: every sample accounted for, error
rows that name the shard and member, `errors retry` rebuilding what failed, "not downloaded"
counted apart."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.readers.test_inputs import img2dataset_folder, png, sample, write_tar
from tests.runs import embeddings, error_rows, make_cfg

runner = CliRunner()


def test_folder_and_tars_accounted_with_retryable_error_rows(tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(3):
        (photos / f"p{i}.png").write_bytes(png(i))
    (photos / "bad.png").write_bytes(b"not an image at all")
    shard = write_tar(tmp_path / "00000.tar", sample("k1", 1) + [("k2.jpg", b"garbage"), ("k2.txt", b"two")]
                      + sample("k3", 3))
    out = tmp_path / "out"
    res = run_encode(make_cfg([photos, shard], out), encoder_factory=factory(FakeEncoder()))
    c = res.counters
    assert c.balanced and c.mod("image").encoded == 5 and c.mod("text").encoded == 3
    failed = {r["id"]: r for r in error_rows(out)}
    assert set(failed) == {"bad.png", "k2"} and failed["k2"]["manifest"] == str(shard)
    assert failed["k2"]["line"] == 3 and failed["k2"]["offset"] > 0 and failed["k2"]["code"] == 400
    retry = tmp_path / "retry.jsonl"
    res_cli = runner.invoke(app, ["errors", "retry", str(out), "-o", str(retry)], catch_exceptions=False)
    assert res_cli.exit_code == 0, res_cli.output
    rebuilt = {r["id"]: r for r in map(json.loads, retry.read_text().splitlines())}
    assert rebuilt["bad.png"] == {"id": "bad.png", "image": str(photos / "bad.png")}
    assert rebuilt["k2"]["image"].startswith("data:") and "text" not in rebuilt["k2"]  # the text was encoded
    (photos / "bad.png").write_bytes(png(9))  # fixed at the source
    again = run_encode(make_cfg([retry], out), encoder_factory=factory(FakeEncoder()))
    assert again.counters.mod("image").encoded == 1 and ("bad.png", "image") in embeddings(out)
    summary = runner.invoke(app, ["errors", "summary", str(out), "--json"], catch_exceptions=False)
    assert json.loads(summary.stdout)["errors"] == 1  # only the tar's garbage image is left


def test_an_img2dataset_run_counts_not_downloaded_apart(tmp_path: Path) -> None:
    root = img2dataset_folder(tmp_path / "laion")
    res = run_encode(make_cfg([root], tmp_path / "out", keep=("url",)), encoder_factory=factory(FakeEncoder()))
    c = res.counters
    assert c.not_downloaded == 6 and c.invalid == 0 and c.rows_skipped == 0 and c.balanced
    assert c.mod("image").encoded == 9 and c.mod("text").encoded == 9
    summary = runner.invoke(app, ["status", str(tmp_path / "out")], catch_exceptions=False)
    assert summary.exit_code == 0


def test_bad_inputs_become_error_rows_and_the_counts_add_up(tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "ok.png").write_bytes(png(1))
    (photos / "gone.png").symlink_to(tmp_path / "nowhere.png")  # an image file that cannot be read
    (photos / "latin.png").write_bytes(png(2))
    (photos / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))  # a caption that is not UTF-8
    shards = tmp_path / "shards"
    shards.mkdir()
    write_tar(shards / "0.tar", sample("k1", 1) + sample("dup", 2) + [("k2.jpg", b"not an image")])
    write_tar(shards / "1.tar", sample("dup", 3) + [("meta.json", b'{"url": "x"}')])  # again; neither image nor text
    write_tar(shards / "2.tar", [])  # an empty tar
    out = tmp_path / "out"
    res = run_encode(make_cfg([photos, shards / "{0..3}.tar"], out), encoder_factory=factory(FakeEncoder()))
    c = res.counters
    assert c.balanced and c.rows == 10 and c.invalid == 5  # folder 3, tars 3 + 2 + 1, the missing one 1
    assert c.mod("image").encoded == 3 and c.mod("image").failed == {404: 1, 400: 1} and c.mod("text").encoded == 2
    got = sorted((r["id"] or r["manifest"].rsplit("/", 1)[-1], r["reason"], r["code"]) for r in error_rows(out))
    assert got == [
        ("2.tar", "manifest.bad_shard", 400),
        ("3.tar", "manifest.missing_shard", 404),
        ("dup", "manifest.duplicate_id", 409),
        ("gone.png", "media.not_found", 404),
        ("k2", "media.unreadable", 400),
        ("latin.png", "manifest.invalid_row", 400),
        ("meta", "manifest.empty_row", 400),
    ]


def test_the_cli_takes_quoted_ranges_folders_and_img2dataset_outputs(tmp_path: Path) -> None:
    for n in range(2):
        write_tar(tmp_path / f"{n:05d}.tar", sample(f"s{n}", n))
    root = img2dataset_folder(tmp_path / "laion")
    out = tmp_path / "out"
    res = runner.invoke(app, ["encode", str(tmp_path / "{00000..00002}.tar"), str(root), "--out", str(out),
                              "--progress", "none", "--workers", "0", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output  # 00002.tar is missing: one error row, the rest encoded
    counters = json.loads(res.stdout)["counters"]
    assert counters["not_downloaded"] == 6 and counters["invalid"] == 1 and counters["rows"] == 2 + 1 + 9 + 6
    assert counters["encoded"] == 2 * 11 and counters["balanced"]
    assert "6 not downloaded" in res.stderr
    missing = runner.invoke(app, ["encode", str(tmp_path / "00009.tar"), "--out", str(out)], catch_exceptions=False)
    assert missing.exit_code == 2 and "does not exist" in missing.output  # a path given as it is
    no_backend = runner.invoke(app, ["encode", "nosuchproto://bucket/*.tar", "--out", str(tmp_path / "o2")],
                               catch_exceptions=False)
    assert no_backend.exit_code == 3 and "no fsspec backend for nosuchproto://" in no_backend.output


def test_a_folders_error_rows_follow_their_files_when_others_come_and_go(tmp_path: Path) -> None:
    """A folder sample is keyed by its path: deleting or adding files never moves an error row onto
    another file, never hides a broken file, never lists one twice (a deleted file's row stays)."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in "abcd":
        (photos / f"{name}.png").write_bytes(png(ord(name)))
    for name in "bc":
        (photos / f"{name}.txt").write_bytes("caf\xe9".encode("latin-1"))  # invalid: not UTF-8

    def current_errors() -> list[str]:
        res = runner.invoke(app, ["errors", "list", str(out), "--json"], catch_exceptions=False)
        return sorted(json.loads(line)["id"] for line in res.stdout.splitlines())

    out = tmp_path / "out"
    run_encode(make_cfg([photos], out), encoder_factory=factory(FakeEncoder()))
    assert current_errors() == ["b.png", "c.png"]
    (photos / "b.png").unlink()
    (photos / "b.txt").unlink()
    again = run_encode(make_cfg([photos], out), encoder_factory=factory(FakeEncoder()))
    assert again.counters.invalid_before == 1 and again.counters.invalid == 0
    assert current_errors() == ["b.png", "c.png"]  # c still broken, still listed: d.png does not resolve it
    (photos / "a0.png").write_bytes(png(1))
    (photos / "a0.txt").write_bytes(b"\xff")
    third = run_encode(make_cfg([photos], out), encoder_factory=factory(FakeEncoder()))
    assert third.counters.invalid == 1 and third.counters.invalid_before == 1
    assert current_errors() == ["a0.png", "b.png", "c.png"]
    rows = [r for r in error_rows(out) if r["status"] == "failed"]
    assert sorted(r["key"] for r in rows) == ["a0.png", "b.png", "c.png"]
    retry = tmp_path / "retry.jsonl"
    (photos / "c.txt").write_text("fixed")
    fourth = run_encode(make_cfg([photos], out), encoder_factory=factory(FakeEncoder()))
    assert fourth.counters.mod("text").encoded == 1 and current_errors() == ["a0.png", "b.png"]
    assert runner.invoke(app, ["errors", "retry", str(out), "-o", str(retry)]).exit_code == 0


def test_folder_error_rows_written_before_keys_are_still_honoured(tmp_path: Path) -> None:
    from mmenc_cli.output import OutDir

    photos = tmp_path / "photos"
    photos.mkdir()
    for name in "abc":
        (photos / f"{name}.png").write_bytes(png(ord(name)))
    (photos / "b.txt").write_bytes(b"\xff")
    out = tmp_path / "out"
    run_encode(make_cfg([photos], out), encoder_factory=factory(FakeEncoder()))
    for path in OutDir(out).error_report_paths():  # as an earlier mmenc wrote them: no "key" field
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "key"}) + "\n" for r in rows))
    (photos / "a.png").unlink()  # b's place in the walk moves from 1 to 0
    again = run_encode(make_cfg([photos], out), encoder_factory=factory(FakeEncoder()))
    assert again.counters.invalid_before == 1 and again.counters.invalid == 0
    listed = runner.invoke(app, ["errors", "list", str(out), "--json"], catch_exceptions=False)
    assert [json.loads(line)["id"] for line in listed.stdout.splitlines()] == ["b.png"]
