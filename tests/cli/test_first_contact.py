"""What a newcomer meets first: `--version`, help that says what the README says, error lines that
never show Python's None or a bare offset, `--keep a,b` as two fields."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mmenc_cli import __version__
from mmenc_cli.cli import app
from mmenc_cli.cli.encode import keep_fields
from mmenc_cli.cli.render import error_line, print_error_summary

runner = CliRunner()


def test_version() -> None:
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"mmenc {__version__}"


def test_help_says_what_the_readme_says() -> None:
    text = " ".join(runner.invoke(app, ["encode", "--help"], terminal_width=200).stdout.split())
    assert "open_clip:ARCH/PRETRAINED" in text and "timm:NAME" in text
    assert "every one the model has a tower for; video only when asked" in text
    errors_list = " ".join(runner.invoke(app, ["errors", "list", "--help"], terminal_width=200).stdout.split())
    assert "image, text, audio, video" in errors_list and "JSON lines" in errors_list


def test_error_lines_name_places_and_never_none() -> None:
    invalid = {"code": 400, "reason": "manifest.invalid_json", "stage": "validate", "modality": None, "id": None,
               "manifest": "/d/m.jsonl", "line": 7, "offset": 120, "message": "not JSON"}
    member = {"code": 400, "reason": "media.unreadable", "stage": "decode", "modality": "image", "id": "k1",
              "manifest": "/d/shard-0.tar", "line": None, "offset": 0, "key": "k1", "message": "truncated"}
    row = {"code": 404, "reason": "media.not_found", "stage": "load", "modality": "image", "id": "r3",
           "manifest": "/d/m.parquet", "line": None, "offset": 0, "message": "missing"}
    lines = [error_line(r) for r in (invalid, member, row)]
    assert lines[0] == "400 manifest.invalid_json [validate/-] (no id) /d/m.jsonl:7: not JSON"
    assert "/d/shard-0.tar member k1:" in lines[1]
    assert "/d/m.parquet offset 0:" in lines[2]
    assert not any("None" in line or "@" in line for line in lines)


def test_the_summary_shows_no_none(capsys) -> None:  # type: ignore[no-untyped-def]
    print_error_summary("OUT", {"errors": 1, "groups": [{"code": 400, "reason": "manifest.invalid_json",
                                                         "stage": None, "modality": None, "count": 1,
                                                         "example_id": None, "example": "not JSON"}]})
    assert "None" not in capsys.readouterr().out


def test_keep_takes_a_comma_list(tmp_path: Path) -> None:
    assert keep_fields(["a,b", "c", " d , "]) == ("a", "b", "c", "d")
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"id": f"i{k}", "text": "t", "a": "A", "b": "B"}) + "\n" for k in range(3)))
    res = runner.invoke(app, ["encode", str(m), "--out", str(tmp_path / "out"), "--keep", "a,b", "--workers", "0",
                              "--progress", "none"])
    assert res.exit_code == 0, res.output
    import pyarrow.dataset as ds

    assert {"a", "b"} <= set(ds.dataset(str(tmp_path / "out")).schema.names)


def test_inspect_of_a_folder_that_is_no_output_says_so_first(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not an output")
    for folder, said in ((tmp_path, "is not an mmenc output"), (tmp_path / "nope", "no such output folder")):
        res = runner.invoke(app, ["inspect", str(folder)])
        assert res.exit_code == 3 and said in res.output and "shard" not in res.stdout


def test_inspect_header_fits_80_columns(tmp_path: Path) -> None:
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"id": "a", "text": "t"}) + "\n")
    assert runner.invoke(app, ["encode", str(m), "--out", str(tmp_path / "out"), "--workers", "0",
                               "--progress", "none"]).exit_code == 0
    res = runner.invoke(app, ["inspect", str(tmp_path / "out")], terminal_width=80)
    assert res.exit_code == 0
    head = res.stdout.splitlines()[:4]
    assert head[1].startswith("  model ") and head[2].startswith("  revision ") and "None" not in res.stdout
    assert all(len(line) <= 80 for line in head[1:])
