"""Inputs where the data lives: folders, WebDataset tars (globs, brace ranges, damage), Arrow files
and saved datasets, img2dataset outputs, fsspec URLs. Every sample keeps its own key and is
accounted for; task slices are disjoint and complete."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from mmenc_cli.config import ManifestConfig, MediaConfig
from mmenc_cli.errors import ManifestError
from mmenc_cli.media import load_bytes
from mmenc_cli.readers import iter_rows, read_raw_row
from mmenc_cli.readers.files import expand_braces
from mmenc_cli.records import InvalidRow, ManifestRow, NotDownloaded


def png(seed: int = 0, size: tuple[int, int] = (8, 6)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (seed * 40 % 256, 90, 200)).save(buf, "PNG")
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def sample(key: str, n: int, text: bool = True, meta: dict[str, Any] | None = None, image: str = "jpg") -> list:
    out = [(f"{key}.{image}", png(n))]
    if text:
        out.append((f"{key}.txt", f"caption {n}".encode()))
    if meta is not None:
        out.append((f"{key}.json", json.dumps(meta).encode()))
    return out


def rows(inputs: list[Any], cfg: ManifestConfig | None = None, task: tuple[int, int] = (0, 1)) -> list[Any]:
    return list(iter_rows([str(p) for p in inputs], cfg or ManifestConfig(), *task))


def test_brace_ranges_expand_like_a_shell() -> None:
    assert expand_braces("s/{0000..0002}.tar") == ["s/0000.tar", "s/0001.tar", "s/0002.tar"]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("plain{}") == ["plain{}"]


def test_a_folder_is_a_manifest(tmp_path: Path) -> None:
    root = tmp_path / "photos"
    (root / "b" / "deep").mkdir(parents=True)
    (root / "a.png").write_bytes(png(1))
    (root / "a.txt").write_text("  the caption of a  \n")
    (root / "a.json").write_text(json.dumps({"tag": "x"}))
    (root / "b" / "c.JPG").write_bytes(png(2))
    (root / "b" / "deep" / "d.webp").write_bytes(png(3))
    (root / ".hidden.png").write_bytes(png(4))
    (root / ".cache").mkdir()
    (root / ".cache" / "e.png").write_bytes(png(5))
    (root / "notes.md").write_text("not an image")
    (root / "b" / "loop").symlink_to(root, target_is_directory=True)  # followed once, not forever
    got = rows([root], ManifestConfig(keep=("tag",)))
    assert [r.id for r in got] == ["a.png", "b/c.JPG", "b/deep/d.webp"]
    assert all(isinstance(r, ManifestRow) for r in got)
    assert got[0].text == "the caption of a" and got[0].keep == {"tag": "x"} and got[1].text is None
    assert got[0].image == "a.png" and got[0].base_dir == str(root) and [r.offset for r in got] == [0, 1, 2]
    shares = [rows([root], task=(i, 2)) for i in range(2)]
    assert sorted(r.id for share in shares for r in share) == [r.id for r in got]
    assert not {r.id for r in shares[0]} & {r.id for r in shares[1]}
    assert read_raw_row(str(root), 2, key="b/deep/d.webp")["__image__"] == "b/deep/d.webp"


def test_webdataset_samples_keep_their_keys(tmp_path: Path) -> None:
    shard = write_tar(tmp_path / "00000.tar", [
        *sample("train/000001", 1, meta={"label": 3, "uid": "u1"}),
        *sample("train/000002", 2, text=False, image="png"),
        ("train/000003.txt", b"text only"),
    ])
    got = rows([shard], ManifestConfig(keep=("label",)))
    assert [r.id for r in got] == ["train/000001", "train/000002", "train/000003"]
    first = got[0]
    assert first.image == png(1) and first.text == "caption 1" and first.keep == {"label": 3}
    assert got[1].image == png(2) and got[1].text is None and got[2].image is None and got[2].text == "text only"
    assert (first.line, first.offset) == (1, 0) and got[1].offset > first.offset
    assert read_raw_row(str(shard), got[1].offset)["png"] == png(2)
    by_uid = rows([shard], ManifestConfig(id_key="uid"))
    assert isinstance(by_uid[0], ManifestRow) and by_uid[0].id == "u1" and isinstance(by_uid[1], InvalidRow)
    only_png = rows([shard], ManifestConfig(image_key="png"))
    assert only_png[0].image is None and only_png[1].image == png(2)


def test_damaged_shards_keep_what_was_read_and_the_run_goes_on(tmp_path: Path) -> None:
    write_tar(tmp_path / "00000.tar", sample("a", 1) + sample("b", 2) + sample("a", 3))  # "a" again: orphan
    full = write_tar(tmp_path / "full.tar", [m for i in range(6) for m in sample(f"k{i}", i)]).read_bytes()
    (tmp_path / "00001.tar").write_bytes(full[:5000])  # cut after k2's image, before its text
    (tmp_path / "00002.tar").write_bytes(b"")  # an empty file
    write_tar(tmp_path / "00003.tar", [("no-suffix", b"x")] + sample("c", 4))
    (tmp_path / "00004.tar").write_bytes(b"this is not a tar at all" * 40)
    write_tar(tmp_path / "00005.tar", [])  # a tar with no members
    got = rows([tmp_path / "{00000..00006}.tar"])
    kinds = [(os.path.basename(r.manifest), r.error.reason) if isinstance(r, InvalidRow) else r.id for r in got]
    assert kinds == [
        "a", "b", ("00000.tar", "manifest.invalid_row"),  # the orphan: one row for its two members
        "k0", "k1", ("00001.tar", "manifest.bad_shard"),  # k2 may lack members: lost with the rest
        ("00002.tar", "manifest.bad_shard"),
        ("00003.tar", "manifest.invalid_row"), "c",
        ("00004.tar", "manifest.bad_shard"), ("00005.tar", "manifest.bad_shard"),
        ("00006.tar", "manifest.missing_shard"),  # named by the range, never written
    ]
    cut = got[5]
    assert cut.error.message.startswith(f"{tmp_path / '00001.tar'} is truncated or corrupt from byte 4096 on")
    assert (cut.line, cut.offset) == (5, 4096) and "consecutive" in got[2].error.message
    assert "no samples" in got[10].error.message and got[11].error.code == 404 and cut.error.code == 400


def test_tar_shards_are_split_whole_between_tasks_by_size(tmp_path: Path) -> None:
    for n in range(7):
        write_tar(tmp_path / f"{n:05d}.tar", [m for i in range(1 + n % 3) for m in sample(f"s{n}-{i}", i)])
    pattern = str(tmp_path / "*.tar")
    everything = [r.id for r in rows([pattern])]
    shares = [[r for r in rows([pattern], task=(i, 3))] for i in range(3)]
    ids = [r.id for share in shares for r in share]
    assert sorted(ids) == sorted(everything) and len(ids) == len(set(ids))
    for share in shares:  # whole shards: every sample of a shard in the same task
        assert len({os.path.basename(r.manifest) for r in share}) * 1 >= 1
    owners = {}
    for t, share in enumerate(shares):
        for r in share:
            assert owners.setdefault(r.manifest, t) == t
    assert sum(1 for share in shares if share) == 3


def test_a_plain_path_that_is_missing_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not found"):
        rows([tmp_path / "nope.tar"])
    with pytest.raises(ManifestError, match="matches nothing"):
        rows([tmp_path / "*.tar"])


def test_arrow_files_and_saved_datasets(tmp_path: Path) -> None:
    import pyarrow as pa

    table = pa.table({"id": [f"r{i}" for i in range(10)], "text": [f"text {i}" for i in range(10)],
                      "image": [{"bytes": png(i), "path": None} if i % 2 else None for i in range(10)]})
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=3):
            writer.write_batch(batch)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=4):
            writer.write_batch(batch)
    for name in ("file.arrow", "stream.arrow"):
        got = rows([tmp_path / name])
        assert [r.id for r in got] == [f"r{i}" for i in range(10)] and got[3].image == png(3)
        assert got[2].image is None and [r.offset for r in got] == list(range(10))
        shares = [rows([tmp_path / name], task=(i, 2)) for i in range(2)]
        assert sorted(r.id for s in shares for r in s) == sorted(r.id for r in got)
    assert read_raw_row(str(tmp_path / "stream.arrow"), 5)["id"] == "r5"
    whole = (tmp_path / "stream.arrow").read_bytes()
    (tmp_path / "cut.arrow").write_bytes(whole[:len(whole) * 2 // 3])  # a stream cut in its second batch
    (tmp_path / "junk.arrow").write_bytes(b"not arrow" * 100)
    for name, kept in (("cut.arrow", 4), ("junk.arrow", 0)):
        got = rows([tmp_path / name])
        assert [r.id for r in got[:-1]] == [f"r{i}" for i in range(kept)]
        assert isinstance(got[-1], InvalidRow) and got[-1].error.reason == "manifest.bad_shard"
        assert got[-1].offset == kept and f"from row {kept} on" in got[-1].error.message
        shares = [rows([tmp_path / name], task=(i, 2)) for i in range(2)]  # the damage is reported once
        assert sorted(r.id or "damage" for s in shares for r in s) == sorted(r.id or "damage" for r in got)


def test_a_dataset_saved_with_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    images = [Image.open(io.BytesIO(png(i))) for i in range(4)]
    ds = datasets.Dataset.from_dict({"id": ["a", "b", "c", "d"], "image": images, "text": ["w", "x", "y", "z"]},
                                    features=datasets.Features({"id": datasets.Value("string"),
                                                                "image": datasets.Image(),
                                                                "text": datasets.Value("string")}))
    ds.save_to_disk(str(tmp_path / "saved"))
    got = rows([tmp_path / "saved"])
    assert [r.id for r in got] == ["a", "b", "c", "d"] and all(isinstance(r.image, bytes) for r in got)
    assert Image.open(io.BytesIO(got[2].image)).size == (8, 6)


def img2dataset_folder(root: Path) -> Path:
    """The three layouts img2dataset writes, one shard each, keys of 9 digits."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()

    def meta(shard: int, statuses: list[str], images: bool = False) -> pa.Table:
        keys = [f"{shard:05d}{i:04d}" for i in range(len(statuses))]
        cols: dict[str, Any] = {"key": keys, "url": [f"http://x/{k}.jpg" for k in keys],
                                "caption": [f"caption {k}" for k in keys], "status": statuses,
                                "error_message": [None if s == "success" else "404" for s in statuses]}
        if images:
            cols["jpg"] = [png(i) if s == "success" else None for i, s in enumerate(statuses)]
        return pa.table(cols)

    statuses = ["success", "failed_to_download", "success", "success", "failed_to_resize"]
    for shard in range(3):
        table = meta(shard, statuses, images=shard == 2)
        pq.write_table(table, root / f"{shard:05d}.parquet")
        (root / f"{shard:05d}_stats.json").write_text(json.dumps({"count": 5, "successes": 3}))
        ok = [r for r in table.to_pylist() if r["status"] == "success"]
        if shard == 0:
            write_tar(root / "00000.tar", [m for r in ok for m in sample(r["key"], 1, meta={"url": r["url"]})])
        elif shard == 1:
            (root / "00001").mkdir()
            for r in ok:
                (root / "00001" / f"{r['key']}.jpg").write_bytes(png(2))
                (root / "00001" / f"{r['key']}.txt").write_text(r["caption"])
                (root / "00001" / f"{r['key']}.json").write_text(json.dumps({"url": r["url"]}))
    return root


def test_an_img2dataset_folder_in_each_layout(tmp_path: Path) -> None:
    root = img2dataset_folder(tmp_path / "laion")
    got = rows([root], ManifestConfig(keep=("url",)))
    samples = [r for r in got if isinstance(r, ManifestRow)]
    missing = [r for r in got if isinstance(r, NotDownloaded)]
    assert [r.id for r in samples] == ["000000000", "000000002", "000000003", "000010000", "000010002",
                                       "000010003", "000020000", "000020002", "000020003"]
    assert len(missing) == 6 and {r.status for r in missing} == {"failed_to_download", "failed_to_resize"}
    assert all(r.image is not None for r in samples) and samples[3].text == "caption 000010000"
    assert samples[0].keep == {"url": "http://x/000000000.jpg"} and samples[6].keep["url"] == "http://x/000020000.jpg"
    shares = [rows([root], task=(i, 2)) for i in range(2)]
    assert sum(len(s) for s in shares) == len(got)


def test_inputs_through_fsspecs_local_filesystem(tmp_path: Path) -> None:
    """`local://` goes through fsspec's LocalFileSystem (what a remote store goes through), not os."""
    pytest.importorskip("fsspec")
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "b.png").write_bytes(png(2))
    (tmp_path / "m.jsonl").write_text('{"id": "b", "image": "pics/b.png"}\n')
    for n in range(3):
        write_tar(tmp_path / f"{n:05d}.tar", sample(f"k{n}", n))
    url = f"local://{tmp_path}"
    got = rows([f"{url}/m.jsonl", f"{url}/{{00000..00003}}.tar", f"{url}/pics"])
    assert [r.id if isinstance(r, ManifestRow) else r.error.reason for r in got] == [
        "b", "k0", "k1", "k2", "manifest.missing_shard", "b.png"]
    assert got[1].image == png(0) and got[0].base_dir == url
    assert load_bytes(got[0].image, got[0].base_dir, MediaConfig(), 0.0)[0] == png(2)
    shares = [rows([f"{url}/*.tar"], task=(i, 2)) for i in range(2)]
    assert sorted(r.id for s in shares for r in s) == ["k0", "k1", "k2"]


def test_inputs_behind_fsspec_urls(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe("/in/m.jsonl", b'{"id": "a", "text": "one"}\n{"id": "b", "image": "pics/b.png"}\n')
    fs.pipe("/in/pics/b.png", png(1))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in sample("k1", 1):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    fs.pipe("/in/shards/00000.tar", buf.getvalue())
    got = rows(["memory://in/m.jsonl", "memory://in/shards/*.tar", "memory://in/pics"])
    assert [r.id for r in got] == ["a", "b", "k1", "b.png"]
    assert (got[1].base_dir, got[3].base_dir, got[3].image) == ("memory://in", "memory://in/pics", "b.png")
    assert got[2].image == png(1)
    for row in (got[1], got[3]):  # a relative image path is read from the same store
        assert load_bytes(row.image, row.base_dir, MediaConfig(), 0.0)[0] == png(1)
    with pytest.raises(ManifestError, match="no fsspec backend for nosuchproto://"):
        rows(["nosuchproto://bucket/m.jsonl"])
    try:
        import s3fs  # noqa: F401
    except ImportError:  # the usual case here: the backend is missing, and the error names it
        with pytest.raises(ManifestError, match="s3fs"):
            rows(["s3://bucket/m.jsonl"])


def test_a_folder_groups_the_media_of_one_stem_one_file_per_medium(tmp_path: Path) -> None:
    """`a.jpg` + `a.mp4` are one sample; `a.png` (a second image of the stem) is its own sample,
    never dropped; a retried row reads back the same sample."""
    from mmenc_cli.readers.folder import folder_records
    from mmenc_cli.readers.reread import read_record

    for name in ("a.jpg", "a.png", "a.mp4", "b.flac", "b.jpg", "b.txt", "c.webm"):
        (tmp_path / name).write_bytes(b"x")
    got = [(n, rec) for _, n, rec, err in folder_records(str(tmp_path), None, 1000) if err is None]
    media = {rec["__key__"]: {k: v for k, v in rec.items() if k in ("__image__", "__video__", "__audio__")}
             for _, rec in got}
    assert media == {"a.jpg": {"__image__": "a.jpg", "__video__": "a.mp4"}, "a.png": {"__image__": "a.png"},
                     "b.flac": {"__audio__": "b.flac", "__image__": "b.jpg"}, "c.webm": {"__video__": "c.webm"}}
    assert [rec["__key__"] for _, rec in got] == ["a.jpg", "a.png", "b.flac", "c.webm"]
    assert got[2][1]["__text__"] == "x"
    for n, rec in got:
        assert read_record(str(tmp_path), n, key=rec["__key__"])[0] == rec
        assert read_record(str(tmp_path), n)[0] == rec  # by walk position
