"""An empty text is the same error row from every format: 422 `text.empty` for the item (a CSV
cell in the text column is an empty text, as `""` is in JSONL and Parquet, not a missing field)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.runs import error_rows, make_cfg

TEXTS = {"a": "", "b": "   ", "c": "a real text"}


def write(kind: str, folder: Path) -> Path:
    if kind == "jsonl":
        path = folder / "m.jsonl"
        path.write_text("".join(json.dumps({"id": k, "text": t}) + "\n" for k, t in TEXTS.items()))
    elif kind in ("csv", "tsv"):
        sep = "," if kind == "csv" else "\t"
        path = folder / f"m.{kind}"
        path.write_text(f"id{sep}text\n" + "".join(f"{k}{sep}{t}\n" for k, t in TEXTS.items()))
    elif kind == "parquet":
        path = folder / "m.parquet"
        pq.write_table(pa.table({"id": list(TEXTS), "text": list(TEXTS.values())}), path)
    else:
        path = folder / "s.tar"
        with tarfile.open(path, "w") as t:
            for k, text in TEXTS.items():
                info = tarfile.TarInfo(f"{k}.txt")
                info.size = len(text.encode())
                t.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv", "tsv", "parquet", "tar"])
def test_an_empty_text_is_422_from_every_format(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    result = run_encode(make_cfg([write(kind, tmp_path)], out), encoder_factory=factory(FakeEncoder()))
    assert result.counters.encoded_now == 1 and result.counters.invalid == 0
    assert sorted((r["id"], r["code"], r["reason"]) for r in error_rows(out)) == \
        [("a", 422, "text.empty"), ("b", 422, "text.empty")]
