"""Key packs (`output/keyindex.py`): a resume reads a runner's packs instead of one key file a
shard, and falls back to the key files wherever a pack is missing, cut, or names a shard that
is gone, or fails its checksum; what a resume skips never depends on the packs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from mmenc_cli.errors import OutputError
from mmenc_cli.output import OutDir
from mmenc_cli.output import keyindex
from mmenc_cli.output.fs import LocalFS
from mmenc_cli.output.history import load_history
from mmenc_cli.output.keys import SEAL
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.runs import embeddings, make_cfg

N = 23  # texts; shards of 2: 12 shards, packs of 5: 5 + 5 + 2


@pytest.fixture(autouse=True)
def small_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyindex, "PACK_SHARDS", 5)


def manifest(path: Path, n: int = N) -> Path:
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(n)))
    return path


def run(m: Path, out: Path, **kw: Any):  # type: ignore[no-untyped-def]
    return run_encode(replace(make_cfg([m], out, shard_size=2), **kw), encoder_factory=factory(FakeEncoder()))


class Reads:
    """The key files and packs a LocalFS reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real = LocalFS.read_many

        def read_many(fs: LocalFS, paths: list[Any]) -> Any:
            self.paths += [str(p) for p in paths]
            return real(fs, paths)

        monkeypatch.setattr(LocalFS, "read_many", read_many)

    def of(self, suffix: str) -> list[str]:
        return [p for p in self.paths if p.endswith(suffix)]


def test_a_resume_reads_packs_not_key_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, out = manifest(tmp_path / "m.jsonl"), tmp_path / "out"
    first = run(m, out)
    od = OutDir(out)
    packs = sorted(p.name for p in (od.meta / "packs").iterdir())
    assert len(od.shards()) == 12 and packs == ["part-t00000-w00-000000.pack", "part-t00000-w00-000005.pack",
                                                "part-t00000-w00-000010.pack"]  # the last at the close
    reads = Reads(monkeypatch)
    opened: list[str] = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda source, **kw: opened.append(str(source)) or real(source, **kw))
    again = run(m, out)
    assert again.counters.encoded_now == 0 and again.counters.mod("text").encoded_before == N
    assert len(reads.of(".pack")) == 3 and reads.of(".keys") == [] and opened == []
    assert first.counters.encoded_now == N and len(embeddings(out)) == N


@pytest.mark.parametrize("damage", ["missing", "cut", "garbage", "garbled", "version 1"])
def test_a_pack_missing_or_damaged_means_its_key_files_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 damage: str) -> None:
    m, out = manifest(tmp_path / "m.jsonl"), tmp_path / "out"
    run(m, out)
    pack = OutDir(out).meta / "packs" / "part-t00000-w00-000005.pack"
    if damage == "missing":  # a run killed before its pack was written
        pack.unlink()
    else:
        data = pack.read_bytes()
        garbled = data[:-200] + bytes(b ^ 0x5A for b in data[-200:-136]) + data[-136:]  # rows, same size
        pack.write_bytes({"cut": data[:-7], "garbage": b"MMPACK2\n{not json\n", "garbled": garbled,
                          "version 1": b"MMPACK1\n" + data[8:-SEAL]}[damage])
    reads = Reads(monkeypatch)
    assert len(load_history(OutDir(out)).done) == N
    assert sorted(Path(p).name for p in reads.of(".keys")) == [f"part-t00000-w00-{s:06d}.keys" for s in range(5, 10)]
    assert run(m, out).counters.encoded_now == 0


def test_a_shard_deleted_by_hand_is_encoded_again_and_its_pack_dropped(tmp_path: Path) -> None:
    m, out = manifest(tmp_path / "m.jsonl"), tmp_path / "out"
    run(m, out)
    od = OutDir(out)
    last = od.shards()[-1]  # t22 alone; the next run gives its name to a new shard
    last.unlink()
    (od.meta / "keys" / last.name.replace(".parquet", ".keys")).unlink(missing_ok=True)
    manifest(m, N + 3)  # three more texts: the new last shard holds other rows than the pack says
    again = run(m, out)
    assert again.counters.encoded_now == 4 and again.counters.mod("text").encoded_before == N - 1
    assert od.shards()[-2].name == last.name  # the name was given again
    history = load_history(od)
    assert len(history.done) == N + 3 and history.committed.repeated == 0
    assert run(m, out).counters.encoded_now == 0 and len(embeddings(out)) == N + 3


def test_a_shard_whose_size_changed_is_damaged_by_its_pack_too(tmp_path: Path) -> None:
    m, out = manifest(tmp_path / "m.jsonl"), tmp_path / "out"
    run(m, out)
    od = OutDir(out)
    shards = od.shards()
    shards[0].write_bytes(shards[5].read_bytes())  # a readable shard, not the one committed
    for key_file in (od.meta / "keys").glob("*.keys"):
        key_file.unlink()  # only the pack knows its size
    with pytest.raises(OutputError, match=r"part-t00000-w00-000000\.parquet.*committed with"):
        load_history(od)


def test_a_stale_pack_its_runner_cannot_remove_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, out = manifest(tmp_path / "m.jsonl"), tmp_path / "out"
    run(m, out)
    od = OutDir(out)
    od.shards()[-1].unlink()  # its name would be given again, under the pack's old keys
    real = LocalFS.remove
    monkeypatch.setattr(LocalFS, "remove", lambda fs, path: (_ for _ in ()).throw(PermissionError(13, "denied"))
                        if str(path).endswith(".pack") else real(fs, path))
    with pytest.raises(OutputError, match="part-t00000-w00-000010.pack names a shard that is gone"):
        load_history(od, (0, 0))
    history = load_history(od)  # a reader that commits nothing: the stale pack is not used, nor removed
    assert len(history.done) == N - 1
    assert len(load_history(od, (1, 0)).done) == N - 1  # another runner's stale pack is not its to remove
    assert (od.meta / "packs" / "part-t00000-w00-000010.pack").exists()


@pytest.mark.parametrize("head", [b'{"shards": [{"name": "x", "rows": 1e400}]}', b"[" * 100000])
def test_a_pack_header_of_any_damage_is_passed_over(tmp_path: Path, head: bytes) -> None:
    m, out = manifest(tmp_path / "m.jsonl"), tmp_path / "out"
    run(m, out)
    pack = OutDir(out).meta / "packs" / "part-t00000-w00-000000.pack"
    pack.write_bytes(keyindex.seal(b"MMPACK2\n" + head + b"\n"))  # its checksum holds: the header is parsed
    assert len(load_history(OutDir(out), (0, 0)).done) == N and not pack.exists()


def test_a_pack_that_could_not_be_read_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, out = manifest(tmp_path / "m.jsonl"), tmp_path / "out"
    run(m, out)
    real = LocalFS.read_many
    monkeypatch.setattr(LocalFS, "read_many", lambda fs, paths: (None if str(p).endswith(".pack") else data
                                                                 for p, data in zip(paths, real(fs, paths))))
    assert len(load_history(OutDir(out), (0, 0)).done) == N  # a failed GET: the key files are read
    assert len(list((OutDir(out).meta / "packs").iterdir())) == 3
