"""The JSONL reader's fast path for plain text rows gives what the general validation gives.

`jsonl.text_row` takes the records that are plain text rows and returns None for the rest, which
`validate.to_row` handles: over a corpus of valid and invalid records and lines, every row, error
row, offset and line must be the same with the fast path and without it.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pytest

from mmenc_cli.config import ManifestConfig
from mmenc_cli.readers import iter_rows, jsonl
from mmenc_cli.readers.validate import option_keys, to_row
from mmenc_cli.records import InvalidRow

IDS: list[Any] = ["a", "row-7", " padded ", "", "   ", 7, 0, -3, True, None, 1.5, ["x"], {"k": 1}, "é-ü", "\ud800",
                  "🙂", "a\nb"]
TEXTS: list[Any] = ["a cat", "", "   ", "Ünïcödé 🙂", "\ud83d", "x" * 3000, None, 3, ["a"], {"t": "x"}, True,
                    "tab\tand\nnewline", "\u0000nul"]
MEDIA: list[Any] = [None, "img.jpg", "", "  ", b"x", {"bytes": None, "path": "p.jpg"}, 5, ["a"]]


def records(n: int, seed: int) -> list[dict[str, Any]]:
    """Random records mixing every id, text and medium case with extra and kept keys."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rec: dict[str, Any] = {}
        if rng.random() < 0.9:
            rec["id"] = rng.choice(IDS)
        if rng.random() < 0.9:
            rec["text"] = rng.choice(TEXTS)
        for key in ("image", "audio", "video", "img"):
            if rng.random() < 0.15:
                rec[key] = rng.choice(MEDIA)
        if rng.random() < 0.2:
            rec["extra"] = rng.choice(TEXTS)
        out.append(rec)
    return out


@pytest.mark.parametrize("keep", [(), ("extra",)])
@pytest.mark.parametrize("image_key", [None, "img"])
def test_text_row_is_to_row_for_every_record_it_takes(keep: tuple[str, ...], image_key: str | None) -> None:
    keys = option_keys(ManifestConfig(keep=keep, image_key=image_key), "id", ("image",), "text")
    taken = 0
    for i, rec in enumerate(records(3000, seed=len(keep) + 7 * bool(image_key))):
        want = to_row("m.jsonl", i + 1, 10 * i, rec, None, keys, "base", None)
        got = jsonl.text_row("m.jsonl", i + 1, 10 * i, rec, keys, "base")
        if got is not None:
            taken += 1
            assert got == want, rec
    assert taken > 100 or keep  # the corpus exercises the fast path (never with a kept field)


def _lines(seed: int) -> list[bytes]:
    """Manifest lines: the records above as JSON, and broken ones (not JSON, not an object,
    bad UTF-8, blank lines)."""
    rng = random.Random(seed)
    lines = []
    for rec in records(1500, seed):
        lines.append(json.dumps(rec, default=bytes.decode).encode("utf-8", "surrogatepass"))
        r = rng.random()
        if r < 0.05:
            lines.append(b'{"id": "x", "text": ')
        elif r < 0.08:
            lines.append(b"[1, 2]")
        elif r < 0.10:
            lines.append(b'{"id": "bad", "text": "\xff\xfe"}')
        elif r < 0.13:
            lines.append(b"   ")
    return lines


@pytest.mark.parametrize("gz", [False, True])
def test_a_manifest_reads_the_same_with_and_without_the_fast_path(tmp_path: Path, gz: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    body = b"\xef\xbb\xbf" + b"\r\n".join(_lines(3)) + b"\n" + b"\n".join(_lines(4))  # BOM, CRLF, LF
    path = tmp_path / ("m.jsonl.gz" if gz else "m.jsonl")
    path.write_bytes(gzip.compress(body) if gz else body)
    cfg = ManifestConfig(max_row_bytes=2000)  # the 3000-character texts are 413 rows

    def read(task_count: int) -> list[Any]:
        return [r for t in range(task_count) for r in iter_rows([str(path)], cfg, t, task_count)]

    fast = {n: read(n) for n in (1, 3)}
    monkeypatch.setattr(jsonl, "text_row", lambda *args: None)
    for n, rows in fast.items():
        general = read(n)
        assert len(rows) == len(general)
        for a, b in zip(rows, general):
            assert type(a) is type(b) and a.line == b.line and a.offset == b.offset and a.id == b.id
            if isinstance(a, InvalidRow):
                assert (a.error.code, a.error.reason, a.error.message) == (b.error.code, b.error.reason,
                                                                           b.error.message)
            else:
                assert a == b
    assert sum(isinstance(r, InvalidRow) and r.error.code == 413 for r in fast[1]) > 0
    assert sum(not isinstance(r, InvalidRow) for r in fast[1]) > 500


@pytest.mark.parametrize("raw", [
    b'{"id": "a", "text": "b"}\n', b'{"id": "a", "text": "\\ud800"}', b'{"id": "\xc3\xa9"}', b'{"a": "\xff"}',
    b"\xef\xbb\xbf{}", b"\xef{}", b'\xff\xfe{\x00}\x00', b'\xfe\xff\x00{\x00}', b'{\x00}\x00', b'\x00{\x00}',
    b"{}", b"{", b"", b"[1]", b"7", b"\x00\x00\x00{", b"\x00", b'{"x": 1}\r\n', "{\"t\": \"🙂\"}".encode()])
def test_decode_json_is_json_loads(raw: bytes) -> None:
    """Lines decoded as UTF-8 without json's per-line encoding detection give what json.loads
    gives on the bytes: the same object or the same error."""
    try:
        want: Any = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        want = (type(exc).__name__, str(exc))
    record, error = jsonl.decode_json(raw)
    if isinstance(want, tuple):
        assert record is None and error is not None and error.message == f"invalid JSON: {want[1]}"
        assert error.error == want[0]
    elif isinstance(want, dict):
        assert record == want and error is None
    else:
        assert record is None and error is not None and error.reason == "manifest.invalid_json"
