"""Checksums (issue 42): every commit record that a resume, `status` and `inspect` trust carries
one, a record that fails it is ignored and its shard read instead, and `inspect` checks each
shard's bytes against the SHA-256 recorded at its commit. Each case runs on a local OUT and in a
bucket of the S3 server (moto, through s3fs)."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from mmenc_cli.cli.app import app
from mmenc_cli.output import OutDir
from mmenc_cli.output.embeddings import read_embeddings
from mmenc_cli.output.history import load_history
from mmenc_cli.output.keys import MAGIC, MAGIC_V1, SEAL, parse_keys, read_keys
from mmenc_cli.output.shardlog import read_logs
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg
from tests.s3server import bucket, s3_server  # noqa: F401

N = 3000  # texts; shards of 100: 30 shards, one key pack
runner = CliRunner()


@pytest.fixture(params=["local", "s3"])
def out(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The output: a local folder, or a prefix in a fresh bucket of the S3 server."""
    if request.param == "local":
        return str(tmp_path / "out")
    return f"s3://{request.getfixturevalue('bucket')}/out"


def manifest(path: Path, n: int = N) -> Path:
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(n)))
    return path


def encode(m: Path, out: str, **kw: Any) -> Any:
    cfg = make_cfg([m], Path("unused"), shard_size=kw.pop("shard_size", 100), **kw)
    result = run_encode(replace(cfg, writer=replace(cfg.writer, out=out)), encoder_factory=factory(FakeEncoder()))
    assert result.state == "done"
    return result


def ids_once(out: str, n: int = N) -> None:
    """Exactly `n` rows, each id once."""
    ids, matrix = read_embeddings(out, "text")
    assert len(ids) == n == len(set(ids)) and matrix.shape[0] == n


def garble(path: Any, at: int, n: int = 64) -> None:
    """Flip `n` bytes of a file (local or in the bucket) from byte `at`, keeping its size."""
    data = bytearray(path.read_bytes())
    assert at + n <= len(data), (at, len(data))
    data[at:at + n] = bytes(b ^ 0x5A for b in data[at:at + n])
    path.write_bytes(bytes(data))


def body(path: Any) -> int:
    """Where a record's rows start (after its magic and JSON line)."""
    return path.read_bytes().index(b"\n", 8) + 1


def status(out: str) -> tuple[int, dict[str, Any]]:
    done = runner.invoke(app, ["status", out, "--json"])
    return done.exit_code, json.loads(done.stdout)


def test_the_commit_records_the_sha256_of_each_file(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    encode(manifest(tmp_path / "m.jsonl", 250), out, format="safetensors")
    od = OutDir(out)
    for shard in od.shards():
        record = read_keys(od.keys_path(shard.name))
        assert record is not None and record.sealed and record.size == shard.stat().st_size
        assert record.sums == {"shard": hashlib.sha256(shard.read_bytes()).hexdigest(),
                               "side": hashlib.sha256(od.sidecar_path(shard.name).read_bytes()).hexdigest()}
    key_file = od.keys_path(od.shards()[0].name).read_bytes()
    assert key_file.startswith(MAGIC) and hashlib.sha256(key_file[:-SEAL]).digest() == key_file[-SEAL:]
    pack = next((od.meta / "packs").iterdir()).read_bytes()
    assert hashlib.sha256(pack[:-SEAL]).digest() == pack[-SEAL:]


@pytest.mark.parametrize("record", ["pack", "key file"])
def test_a_garbled_record_is_ignored_and_nothing_is_encoded_twice(tmp_path: Path, out: str, record: str) -> None:
    m = manifest(tmp_path / "m.jsonl")
    encode(m, out)
    od = OutDir(out)
    [pack] = od.pack_paths()
    if record == "pack":
        garble(pack, body(pack) + 900)
    else:  # no pack: the key files are the records
        pack.unlink()
        key_file = od.keys_path(od.shards()[3].name)
        garble(key_file, body(key_file) + 700)
    again = encode(m, out)
    assert again.counters.encoded_now == 0 and again.counters.mod("text").encoded_before == N
    ids_once(out)
    code, report = status(out)
    assert code == 0 and report["duplicates"] == {"count": 0, "within_task": 0, "examples": [], "ids": 0}
    inspected = runner.invoke(app, ["inspect", out])
    assert inspected.exit_code == 0 and "duplicate" not in inspected.output, inspected.output


@pytest.mark.parametrize("record", ["pack", "key file"])
def test_a_garbled_record_of_a_resume_that_commits_nothing_is_read_from_its_shard(tmp_path: Path, out: str,
                                                                                   record: str) -> None:
    m = manifest(tmp_path / "m.jsonl")
    encode(m, out)
    od = OutDir(out)
    [pack] = od.pack_paths()
    if record == "key file":
        pack.unlink()
    path = pack if record == "pack" else od.keys_path(od.shards()[0].name)
    garble(path, body(path) + 100)
    history = load_history(od)  # a reader that commits nothing: the same items, from the shard
    assert len(history.done) == N and history.committed.repeated == 0


def test_a_real_duplicate_is_reported_though_its_record_is_garbled(tmp_path: Path, out: str) -> None:
    m = manifest(tmp_path / "m.jsonl")
    encode(m, out)
    od = OutDir(out)
    first = od.shards()[0]
    copy = od.root / first.name.replace("-t00000-", "-t00001-")  # a shard under another task's name
    copy.write_bytes(first.read_bytes())
    [pack] = od.pack_paths()
    garble(pack, body(pack))  # the records of the original: the pack's first rows, and its key file
    key_file = od.keys_path(first.name)
    garble(key_file, body(key_file))
    code, report = status(out)
    assert code == 4 and report["duplicates"]["count"] == 100
    assert report["duplicates"]["examples"][0]["tasks"] == [0, 1]
    inspected = runner.invoke(app, ["inspect", out])
    assert inspected.exit_code == 4 and "100 (id, modality) pairs in several tasks" in inspected.output, \
        inspected.output


def data_pages(shard: Any) -> int:
    """The middle of a shard's embedding data: a Parquet column chunk, or a safetensors tensor."""
    data = shard.read_bytes()
    if shard.name.endswith(".parquet"):
        import pyarrow.parquet as pq

        with shard.open("rb") as fh:
            chunk = pq.ParquetFile(fh).metadata.row_group(0).column(2)
        return int(chunk.data_page_offset + chunk.total_compressed_size // 2)
    head = 8 + int.from_bytes(data[:8], "little")
    return head + (len(data) - head) // 2


@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_inspect_names_a_shard_whose_bytes_changed(tmp_path: Path, out: str, fmt: str) -> None:
    encode(manifest(tmp_path / "m.jsonl", 500), out, format=fmt)
    od = OutDir(out)
    shard = od.shards()[2]
    size = shard.stat().st_size
    garble(shard, data_pages(shard) - 32)
    assert shard.stat().st_size == size
    inspected = runner.invoke(app, ["inspect", out, "--json"])
    assert inspected.exit_code == 3, inspected.output
    report = json.loads(inspected.stdout)
    assert [p for p in report["problems"] if "committed" in p] == [
        p for p in report["problems"] if p.startswith(f"shard {shard.name}: its bytes differ from those committed")]
    assert len(report["problems"]) == 1 and "re-run its task" in report["problems"][0]
    entries = {e["name"]: e for e in report["shards"]}
    assert entries[shard.name]["checksum"] == "differs" and not entries[shard.name]["ok"]
    assert all(e["checksum"] == "ok" and e["ok"] for name, e in entries.items() if name != shard.name)


def test_inspect_names_a_shard_whose_sidecar_changed(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    encode(manifest(tmp_path / "m.jsonl", 300), out, format="safetensors")
    od = OutDir(out)
    sidecar = od.sidecar_path(od.shards()[1].name)
    sidecar.write_bytes(od.sidecar_path(od.shards()[0].name).read_bytes())  # readable, another shard's ids
    inspected = runner.invoke(app, ["inspect", out])
    assert inspected.exit_code == 3
    assert f"shard {od.shards()[1].name}: its sidecars file {sidecar.name} differs" in inspected.output


def as_version_1(path: Path) -> None:
    """Rewrite a key file as an earlier mmenc wrote it: `MMKEYS1`, no checksum."""
    data = path.read_bytes()[:-SEAL]
    path.write_bytes(MAGIC_V1 + data[len(MAGIC):])


def test_a_version_1_key_file_is_used_only_once_its_shard_agrees(tmp_path: Path) -> None:
    m, out = manifest(tmp_path / "m.jsonl", 500), tmp_path / "out"
    encode(m, str(out))
    od = OutDir(out)
    for pack in od.pack_paths():
        pack.write_bytes(b"MMPACK1\n" + pack.read_bytes()[len(b"MMPACK2\n"):-SEAL])  # an earlier pack: not read
    key_files = [od.keys_path(s.name) for s in od.shards()]
    for path in key_files:
        as_version_1(path)
    assert parse_keys(key_files[0].read_bytes()).sealed is False  # type: ignore[union-attr]
    garble(key_files[1], body(key_files[1]) + 40)  # no checksum tells it: its shard does
    history = load_history(od, (0, 0))
    assert len(history.done) == 500 and history.committed.repeated == 0
    sources = history.committed.sources
    assert int((sources == 0).sum()) == 100  # the garbled file's rows: from the shard, sources unknown
    assert all(p.read_bytes().startswith(MAGIC) for p in key_files)  # rewritten, sealed
    assert not od.pack_paths()  # the runner's earlier pack removed
    again = encode(m, str(out))
    assert again.counters.encoded_now == 0
    ids_once(str(out), 500)


def test_a_shard_log_line_whose_sum_fails_is_damaged(tmp_path: Path) -> None:
    out = tmp_path / "out"
    encode(manifest(tmp_path / "m.jsonl", 300), str(out))
    od = OutDir(out)
    [(_, log_path)] = od.shard_log_paths()
    lines = log_path.read_text().splitlines()
    entry = json.loads(lines[1])
    assert set(entry) == {"name", "rows", "bytes", "sum"}
    entry["name"] = entry["name"].replace("000001", "000009")  # still JSON: only its sum tells
    log_path.write_text("\n".join([lines[0], json.dumps(entry), *lines[2:]]) + "\n")
    damaged: list[str] = []
    assert sorted(read_logs(od, damaged)[(0, 0)]) == [s.name for s in od.shards() if "000001" not in s.name]
    assert damaged == [f"{log_path}: line 2 is not a shard entry"]
    code, report = status(str(out))
    assert not any("missing" in p for p in report["problems"])
    inspected = runner.invoke(app, ["inspect", str(out)])
    assert inspected.exit_code == 3 and "line 2 is not a shard entry" in inspected.output


def test_a_version_1_shard_log_line_is_read_as_it_is(tmp_path: Path) -> None:
    out = tmp_path / "out"
    encode(manifest(tmp_path / "m.jsonl", 300), str(out))
    od = OutDir(out)
    [(_, log_path)] = od.shard_log_paths()
    entries = [json.loads(line) for line in log_path.read_text().splitlines()]
    log_path.write_text("".join(json.dumps({k: e[k] for k in ("name", "rows", "bytes")}) + "\n" for e in entries))
    damaged: list[str] = []
    assert len(read_logs(od, damaged)[(0, 0)]) == 3 and damaged == []
    shutil.rmtree(od.meta / "keys")
    shutil.rmtree(od.meta / "packs")
    assert len(load_history(od).done) == 300
    assert np.array_equal(np.sort(load_history(od).committed.ids), load_history(od).committed.ids)
