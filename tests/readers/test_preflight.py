"""A key that names nothing is an error before anything runs: the id key (given or the default), a
media or text key given explicitly and every `--keep` field must be held by a row among the first
1,000 of each input; the message names the input and the fields its rows hold."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmenc_cli.config import ManifestConfig
from mmenc_cli.errors import ManifestError
from mmenc_cli.readers import plan, preflight
from mmenc_cli.readers.preflight import SAMPLE


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tar(path: Path, samples: dict[str, dict[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as t:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return path


def test_the_sources_are_those_plan_gives(tmp_path: Path) -> None:
    a = jsonl(tmp_path / "a.jsonl", [{"id": "1", "text": "x"}])
    b = jsonl(tmp_path / "b.jsonl", [{"id": "2", "text": "y"}, {"id": "3", "text": "z"}])
    pq.write_table(pa.table({"id": ["4"], "text": ["w"]}), tmp_path / "c.parquet")
    inputs = [str(a), str(tmp_path / "b*.jsonl"), str(tmp_path / "c.parquet")]
    assert preflight(inputs, ManifestConfig()) == plan(inputs)


@pytest.mark.parametrize("options, named", [
    (dict(text_key="caption"), '--text-key "caption"'),
    (dict(keep=("source",)), '--keep "source"'),
    (dict(keep=("lang", "source")), '--keep "source"'),
    (dict(id_key="uid"), '--id-key "uid"'),
    (dict(image_key="img"), '--image-key "img"'),
])
def test_a_jsonl_key_no_row_holds_is_refused_naming_what_they_hold(tmp_path: Path, options: dict, named: str) -> None:
    m = jsonl(tmp_path / "m.jsonl", [{"id": str(i), "text": "t", "lang": "en"} for i in range(5)])
    with pytest.raises(ManifestError) as err:
        preflight([str(m)], ManifestConfig(**options))
    assert named in str(err.value) and str(m) in str(err.value)
    assert "its rows hold: id, lang, text" in str(err.value)


def test_the_default_id_key_missing_says_which_option_names_another(tmp_path: Path) -> None:
    m = jsonl(tmp_path / "m.jsonl", [{"uid": "1", "text": "t"}])
    with pytest.raises(ManifestError, match='the id key "id".*--id-key names the field'):
        preflight([str(m)], ManifestConfig())
    preflight([str(m)], ManifestConfig(id_key="uid"))


def test_a_key_held_by_one_row_of_the_first_thousand_is_enough(tmp_path: Path) -> None:
    rows = [{"id": str(i), "text": "t"} for i in range(SAMPLE)]
    rows[SAMPLE - 1]["source"] = "web"
    m = jsonl(tmp_path / "m.jsonl", rows + [{"id": "late", "text": "t", "lang": "en"}])
    preflight([str(m)], ManifestConfig(keep=("source",)))
    with pytest.raises(ManifestError, match=f'first {SAMPLE} holds --keep "lang"'):
        preflight([str(m)], ManifestConfig(keep=("lang",)))


def test_each_input_is_judged_on_its_own(tmp_path: Path) -> None:
    good = jsonl(tmp_path / "good.jsonl", [{"id": "1", "caption": "c"}])
    other = jsonl(tmp_path / "other.jsonl", [{"id": "2", "text": "t"}])
    with pytest.raises(ManifestError, match="other.jsonl.*--text-key \"caption\""):
        preflight([str(good), str(other)], ManifestConfig(text_key="caption"))


def test_tar_shards_csv_and_parquet_are_judged_too(tmp_path: Path) -> None:
    shard = tar(tmp_path / "s.tar", {"a": {"jpg": b"\xff\xd8", "txt": b"hi"}, "b": {"jpg": b"\xff\xd8"}})
    preflight([str(shard)], ManifestConfig())
    with pytest.raises(ManifestError, match='--text-key "caption".*its rows hold: __key__, jpg, txt'):
        preflight([str(shard)], ManifestConfig(text_key="caption"))
    (tmp_path / "m.csv").write_text("id,text\n1,a\n")
    pq.write_table(pa.table({"id": ["1"], "text": ["a"]}), tmp_path / "m.parquet")
    for name in ("m.csv", "m.parquet"):
        preflight([str(tmp_path / name)], ManifestConfig())
        with pytest.raises(ManifestError, match='--keep "source"'):
            preflight([str(tmp_path / name)], ManifestConfig(keep=("source",)))


def test_an_empty_input_and_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    preflight([str(tmp_path / "empty.jsonl")], ManifestConfig(keep=("x",)))  # no row to judge by
    with pytest.raises(ManifestError, match="not found"):
        preflight([str(tmp_path / "nope.jsonl")], ManifestConfig())
