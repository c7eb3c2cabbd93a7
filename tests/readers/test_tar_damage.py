"""Tar shards damaged on a header, cut anywhere, concatenated, or holding links: every sample is a
whole row or is named by an error row; nothing vanishes, nothing comes back partial."""

from __future__ import annotations

import gzip
import json
import io
import os
import random
import subprocess
import tarfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.config import ManifestConfig
from mmenc_cli.readers import iter_rows, read_raw_row
from mmenc_cli.records import InvalidRow, ManifestRow
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.readers.test_inputs import png, sample, write_tar
from tests.runs import embeddings, error_rows, make_cfg

KEYS = [f"k{i}" for i in range(4)]


def shard_bytes(tmp_path: Path, keys: list[str] = KEYS) -> bytes:
    members = [m for n, k in enumerate(keys) for m in sample(k, n + 1, meta={"n": n})]
    return write_tar(tmp_path / "clean.tar", members).read_bytes()


def read(path: Path, **kw: Any) -> list[ManifestRow | InvalidRow]:
    return list(iter_rows([str(path)], ManifestConfig(keep=("n",), **kw)))  # type: ignore[arg-type]


def headers(data: bytes) -> list[int]:
    """The offsets of the member headers of a clean tar."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return [m.offset for m in tf.getmembers()]


def check_accounted(got: list[Any], clean: dict[str, ManifestRow]) -> None:
    """Every row that is a sample is whole (as in the clean shard); every sample of the clean shard is
    a row, an error row naming it, or behind a row that says the rest of the shard is lost."""
    rest = min((r.offset for r in got if isinstance(r, InvalidRow) and "to the end of the shard" in r.error.message),
               default=None)
    named = {r.id for r in got if isinstance(r, InvalidRow)}
    for r in got:
        if isinstance(r, ManifestRow):
            want = clean[r.id]
            assert (r.image, r.text, r.keep, r.offset) == (want.image, want.text, want.keep, want.offset), r.id
        else:
            assert r.error.reason in ("manifest.bad_shard", "manifest.invalid_row"), r.error
    encoded = {r.id for r in got if isinstance(r, ManifestRow)}
    for key, row in clean.items():
        assert key in encoded or key in named or (rest is not None and rest <= row.offset), key


def test_a_cut_anywhere_loses_no_sample_silently(tmp_path: Path) -> None:
    data = shard_bytes(tmp_path)
    clean = {r.id: r for r in read(tmp_path / "clean.tar")}
    end = headers(data)[-1] + 1024
    cuts = sorted(set(range(1, end + 1024, 7)) | {h + d for h in headers(data) for d in (0, 1, 511, 512)} - {0})
    for cut in cuts:
        path = tmp_path / "cut.tar"
        path.write_bytes(data[:cut])
        got = read(path)
        check_accounted(got, clean)
        if cut < end:  # the end-of-archive marker is gone: some row says so
            assert any(isinstance(r, InvalidRow) and r.error.reason == "manifest.bad_shard" for r in got), cut


@pytest.mark.parametrize("where", [0, 2, 100, 124, 148, 156, 257, 345, 500])
def test_a_flipped_byte_in_any_header_fails_only_its_sample(tmp_path: Path, where: int) -> None:
    """A damaged name or size cannot say which member the span was: its neighbours fail too."""
    data = shard_bytes(tmp_path)
    clean = {r.id: r for r in read(tmp_path / "clean.tar")}
    for n, h in enumerate(headers(data)):
        broken = bytearray(data)
        broken[h + where] ^= 0x04
        path = tmp_path / "flip.tar"
        path.write_bytes(bytes(broken))
        got = read(path)
        check_accounted(got, clean)
        encoded = {r.id for r in got if isinstance(r, ManifestRow)}
        hit = KEYS[n // 3]
        assert hit not in encoded and len(encoded) >= len(KEYS) - 2, (where, n, encoded)
        if where not in (0, 2, 124):  # name and size intact: only its own sample fails, by its key
            assert encoded == set(KEYS) - {hit}, (where, n, encoded)
            failed = [r for r in got if isinstance(r, InvalidRow)]
            assert [r.id for r in failed] == [hit] and failed[0].error.code == 400
            assert "bad checksum" in failed[0].error.message


def test_a_zero_block_in_place_of_a_header_is_not_the_end(tmp_path: Path) -> None:
    data = bytearray(shard_bytes(tmp_path))
    h = headers(bytes(data))[4]  # k1's text
    data[h:h + 512] = bytes(512)
    path = tmp_path / "zero.tar"
    path.write_bytes(bytes(data))
    got = read(path)
    assert [r.id for r in got if isinstance(r, ManifestRow)] == ["k0", "k2", "k3"]
    assert [(r.id, r.error.reason) for r in got if isinstance(r, InvalidRow)] == [("k1", "manifest.bad_shard")]


def test_concatenated_tars_are_read_whole(tmp_path: Path) -> None:
    a = shard_bytes(tmp_path, ["a0", "a1"])
    b = shard_bytes(tmp_path, ["b0", "b1", "b2"])
    path = tmp_path / "both.tar"
    path.write_bytes(a + b)
    got = read(path)
    assert [r.id for r in got] == ["a0", "a1", "b0", "b1", "b2"] and all(isinstance(r, ManifestRow) for r in got)
    assert read_raw_row(str(path), got[3].offset)["__key__"] == "b1"
    path.write_bytes(a + b"junk" * 200 + b)  # garbage between them: one row for it, both tars read
    got = read(path)
    assert [r.id for r in got if isinstance(r, ManifestRow)] == ["a0", "a1", "b1", "b2"]
    bad = [r for r in got if isinstance(r, InvalidRow)]
    assert [(r.id, r.error.reason) for r in bad] == [("b0", "manifest.bad_shard")]


def test_a_cut_gzip_shard_is_one_row(tmp_path: Path) -> None:
    packed = gzip.compress(shard_bytes(tmp_path))
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(packed[:len(packed) // 2])
    got = read(path)
    assert isinstance(got[-1], InvalidRow) and got[-1].error.reason == "manifest.bad_shard"
    assert "to the end of the shard" in got[-1].error.message and all(isinstance(r, ManifestRow) for r in got[:-1])


def test_gnu_tar_hard_links_and_symlinks_resolve_to_their_target(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "x.jpg").write_bytes(png(1))
    (root / "a" / "x.txt").write_text("first")
    os.link(root / "a" / "x.jpg", root / "b" / "x.jpg")  # a deduplicated dataset
    (root / "b" / "x.txt").write_text("second")
    (root / "c.jpg").symlink_to("a/x.jpg")  # a sample made of one symlink
    (root / "d.jpg").symlink_to("missing.jpg")
    (root / "e.jpg").symlink_to("../outside.jpg")
    shard = tmp_path / "links.tar"
    subprocess.run(["tar", "cf", str(shard), "-C", str(root), "a", "b", "c.jpg", "d.jpg", "e.jpg"], check=True)
    with tarfile.open(shard) as tf:
        assert tf.getmember("b/x.jpg").islnk()  # GNU tar stored the second name as a link
    got = {r.id: r for r in read(shard)}
    assert got["a/x"].image == got["b/x"].image == got["c"].image == png(1)
    assert got["b/x"].text == "second"
    for key, why in (("d", "not a file earlier in the shard"), ("e", "outside the shard")):
        assert isinstance(got[key], InvalidRow) and why in got[key].error.message
        assert f"{key}.jpg" in got[key].error.message
    assert read_raw_row(str(shard), got["b/x"].offset)["jpg"] == png(1)


def test_links_in_a_gzip_shard_and_chains(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("p.jpg", png(2)),):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for name, kind, target in (("q.jpg", tarfile.LNKTYPE, "p.jpg"), ("r.jpg", tarfile.SYMTYPE, "q.jpg"),
                                   ("s.jpg", tarfile.SYMTYPE, "s.jpg")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tf.addfile(info)
    path = tmp_path / "chain.tgz"
    path.write_bytes(buf.getvalue())
    got = {r.id: r for r in read(path)}
    assert got["p"].image == got["q"].image == got["r"].image == png(2)
    assert isinstance(got["s"], InvalidRow) and "s.jpg" in got["s"].error.message


def test_whole_sample_failures_name_their_sample(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "s.tar", [("big.jpg", b"x" * 5000), ("big.txt", b"caption"),
                                           ("bad.jpg", png(1)), ("bad.txt", b"\xff\xfe not utf-8"),
                                           ("two.JPG", png(2)), ("two.jpg", png(3)), ("ok.jpg", png(4))])
    got = {r.id: r for r in read(shard, max_row_bytes=4096)}
    assert isinstance(got["ok"], ManifestRow)
    big, bad, two = got["big"], got["bad"], got["two"]
    assert isinstance(big, InvalidRow) and big.error.code == 413 and "big.jpg" in big.error.message
    assert "sample big" in big.error.message
    assert isinstance(bad, InvalidRow) and "bad.txt" in bad.error.message and bad.error.code == 400
    assert isinstance(two, InvalidRow) and "two.JPG" in two.error.message and "two.jpg" in two.error.message


def test_a_damaged_shard_in_a_run_reports_each_lost_sample_once(tmp_path: Path) -> None:
    data = bytearray(shard_bytes(tmp_path))
    data[headers(bytes(data))[3] + 148] ^= 0x01  # k1's image header
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "00000.tar").write_bytes(bytes(data))
    other = shard_bytes(tmp_path, ["m0", "m1", "m2", "m3"])
    (shards / "00001.tar").write_bytes(other[:headers(other)[7]])  # cut before m2's text
    out = tmp_path / "out"
    res = run_encode(make_cfg([shards / "0000{0..1}.tar"], out), encoder_factory=factory(FakeEncoder()))
    assert res.counters.balanced
    rows = error_rows(out)
    assert sorted((os.path.basename(r["manifest"]), r["id"], r["code"]) for r in rows) == [
        ("00000.tar", "k1", 400), ("00001.tar", "m2", 400)]
    assert {k for k, _ in embeddings(out)} == {"k0", "k2", "k3", "m0", "m1"}
    again = run_encode(make_cfg([shards / "0000{0..1}.tar"], out), encoder_factory=factory(FakeEncoder()))
    assert again.counters.invalid_before == 2 and len(error_rows(out)) == 2 and again.counters.balanced


def test_random_damage_to_headers_loses_no_sample_silently(tmp_path: Path) -> None:
    """Seeded damage of every kind at once: flipped bytes in one or several headers, blanked or
    overwritten header blocks, then maybe a cut."""
    keys = [f"k{i}" for i in range(6)]
    data = shard_bytes(tmp_path, keys)
    clean = {r.id: r for r in read(tmp_path / "clean.tar")}
    offsets, rng = headers(data), random.Random(7)
    for _ in range(400):
        broken = bytearray(data)
        for h in rng.sample(offsets, rng.choice((1, 1, 2, 3))):
            kind = rng.choice(("flip", "zero", "noise"))
            if kind == "flip":
                broken[h + rng.randrange(512)] ^= rng.randrange(1, 256)
            else:
                broken[h:h + 512] = bytes(512) if kind == "zero" else rng.randbytes(512)
        if rng.random() < 0.3:
            broken = broken[:rng.randrange(1, len(broken))]
        path = tmp_path / "fuzz.tar"
        path.write_bytes(bytes(broken))
        check_accounted(read(path), clean)


def test_a_sample_over_the_row_limit_is_retried_whole(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mmenc_cli.cli import app

    noisy = io.BytesIO()
    Image.frombytes("RGB", (32, 32), random.Random(1).randbytes(32 * 32 * 3)).save(noisy, "PNG")
    assert len(noisy.getvalue()) > 400
    shard = write_tar(tmp_path / "00000.tar", sample("small", 1) + [("big.jpg", noisy.getvalue()),
                                                                  ("big.txt", b"a big one")])
    out, retry = tmp_path / "out", tmp_path / "retry.jsonl"
    cfg = make_cfg([shard], out)
    cfg = replace(cfg, manifest=replace(cfg.manifest, max_row_bytes=400))
    run_encode(cfg, encoder_factory=factory(FakeEncoder()))
    [row] = error_rows(out)
    assert (row["id"], row["code"], row["modality"]) == ("big", 413, None) and "big.jpg" in row["message"]
    runner = CliRunner()
    done = runner.invoke(app, ["errors", "retry", str(out), "-o", str(retry)], catch_exceptions=False)
    assert done.exit_code == 0 and "larger --max-row-bytes" in done.output
    [again] = [json.loads(line) for line in retry.read_text().splitlines()]
    assert again["id"] == "big" and again["text"] == "a big one" and again["image"].startswith("data:image/png")
    run_encode(make_cfg([retry], out), encoder_factory=factory(FakeEncoder()))
    assert {("big", "image"), ("big", "text")} <= set(embeddings(out))
    summary = runner.invoke(app, ["errors", "summary", str(out), "--json"], catch_exceptions=False)
    assert json.loads(summary.stdout)["errors"] == 0
