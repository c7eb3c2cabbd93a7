"""A format added from outside mmenc_cli, in this file alone: `.toy` files of `id<TAB>text` lines,
registered with `readers.register`. It encodes, splits between tasks and retries with no change to
mmenc_cli: planning, slicing, rereading and the error report's retry all ask the format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.config import ManifestConfig
from mmenc_cli.errors import ManifestError, MMError
from mmenc_cli.readers import ManifestError as ReadersManifestError
from mmenc_cli.readers import detect_format, iter_rows, read_row
from mmenc_cli.readers.registry import RANGES, Format, Part, Record, Source, register, unregister
from mmenc_cli.records import InvalidRow, ManifestRow
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.runs import embeddings, error_rows, make_cfg

runner = CliRunner()


def _parse(raw: bytes) -> tuple[dict[str, Any] | None, MMError | None]:
    """One `id<TAB>text` line as a record, or why it is not one."""
    row_id, tab, text = raw.rstrip(b"\n").decode().partition("\t")
    if not tab:
        return None, MMError("a toy line needs a tab", stage="read", reason="manifest.invalid_row")
    return {"id": row_id, "text": text}, None


class Toy(Format):
    """`.toy`: a line a record, split between tasks by byte ranges, found again by byte offset."""

    name, extensions, slicing = "toy", (".toy",), RANGES

    def records(self, src: Source, cfg: ManifestConfig, part: Part) -> Iterator[Record]:
        start = 0
        for line, raw in enumerate(Path(src.path).read_bytes().splitlines(keepends=True), 1):
            if part.b is not None and part.a <= start < part.b:
                yield line, start, *_parse(raw)
            start += len(raw)

    def record(self, path: str, offset: int, limit: int,
               key: str | None) -> tuple[dict[str, Any] | None, MMError | None]:
        data = Path(path).read_bytes()
        if offset >= len(data) or offset > 0 and data[offset - 1:offset] != b"\n":
            raise ManifestError(f"no toy line starts at byte {offset} of {path}")
        return _parse(data[offset:].split(b"\n", 1)[0])


@pytest.fixture
def toy() -> Iterator[Toy]:
    fmt = register(Toy())
    yield fmt
    unregister(fmt)


def toy_file(path: Path, n: int) -> Path:
    """`n` lines `r<i><TAB>text <i>`, line 3 (0-based) without a tab."""
    path.write_text("".join(f"r{i}\ttext {i}\n" if i != 3 else "no tab here\n" for i in range(n)))
    return path


def test_a_registered_format_is_detected_and_reread(tmp_path: Path, toy: Toy) -> None:
    path = toy_file(tmp_path / "rows.toy", 5)
    assert detect_format(str(path)) == "toy"
    offset = len("r0\ttext 0\nr1\ttext 1\n")
    row = read_row(str(path), offset, ManifestConfig(), line=3)
    assert isinstance(row, ManifestRow) and (row.id, row.text, row.base_dir) == ("r2", "text 2", str(tmp_path))
    unregister(toy)
    with pytest.raises(ReadersManifestError, match="from its extension"):
        detect_format(str(path))


def test_a_registered_format_slices_between_tasks(tmp_path: Path, toy: Toy) -> None:
    """Two tasks read disjoint rows that together are the one task's, at the same offsets."""
    path = toy_file(tmp_path / "rows.toy", 40)

    def rows(i: int, k: int) -> list[tuple[str | None, int, bool]]:
        got = iter_rows([str(path)], ManifestConfig(), i, k)
        return [(r.id, r.offset, isinstance(r, InvalidRow)) for r in got if isinstance(r, (ManifestRow, InvalidRow))]

    whole, first, second = rows(0, 1), rows(0, 2), rows(1, 2)
    assert len(whole) == 40 and first and second
    assert not set(first) & set(second) and sorted(first + second, key=lambda r: r[1]) == whole
    assert [r for r in whole if r[2]] == [(None, len("r0\ttext 0\n") * 3, True)]


def test_a_registered_format_encodes_and_retries(tmp_path: Path, toy: Toy) -> None:
    """The toy's rows are encoded, its bad line and its failed row are error rows, and
    `mmenc errors retry` rebuilds the failed row from the toy file."""
    path = toy_file(tmp_path / "rows.toy", 6)
    out = tmp_path / "out"
    enc = FakeEncoder(fail_on=lambda m, p: m == "text" and p == "text 4")
    res = run_encode(make_cfg([path], out), encoder_factory=factory(enc))
    assert res.counters.balanced
    assert sorted(i for i, _ in embeddings(out)) == ["r0", "r1", "r2", "r5"]
    data = path.read_bytes()
    got = [(e["id"], e["modality"], e["reason"], e["line"], e["offset"], e["manifest"]) for e in error_rows(out)]
    assert got == [(None, None, "manifest.invalid_row", 4, data.index(b"no tab"), str(path)),
                   ("r4", "text", "encode.failed", 5, data.index(b"r4\t"), str(path))]
    retry = tmp_path / "retry.jsonl"
    done = runner.invoke(app, ["errors", "retry", str(out), "-o", str(retry)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert [json.loads(line) for line in retry.read_text().splitlines()] == [{"id": "r4", "text": "text 4"}]
