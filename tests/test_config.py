"""The config declares each option's default and whether it is fingerprinted; the fingerprint is
derived from that declaration and stays what earlier mmenc versions wrote (`fixtures/fingerprints.json`:
run.json fingerprints written before it was derived), so their outputs still resume."""

from __future__ import annotations

import json
from dataclasses import MISSING, replace
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.cli.encode import DEMO_MODEL, EncodeOptions, build_config
from mmenc_cli.config import FINGERPRINT, RunConfig, config_fields, fingerprint_fields, option
from mmenc_cli.encoders.libraries import canonical_model
from mmenc_cli.output import OutDir
from mmenc_cli.run.metadata import RECORDED, decode_mode, fingerprint, fingerprint_diff, resolved_dtype

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "samples" / "manifest.jsonl"
CASES = json.loads((Path(__file__).parent / "fixtures" / "fingerprints.json").read_text())["cases"]


def recorded_fingerprint(case: dict[str, Any]) -> dict[str, Any]:
    """The fixture's fingerprint, its model path moved to where the demo model is in this checkout."""
    fp = dict(case["fingerprint"])
    assert fp["model"].endswith("mmenc_cli/demo_model")
    return {**fp, "model": canonical_model(str(DEMO_MODEL))}


def config_of(args: list[str], out: Path) -> RunConfig:
    """The `RunConfig` that `mmenc encode MANIFEST --out OUT ARGS` (demo model) builds."""
    group = typer.main.get_command(app)
    ctx = group.commands["encode"].make_context("encode", [str(MANIFEST), "--out", str(out), *args])
    return build_config(EncodeOptions(**{**ctx.params, "model": str(DEMO_MODEL)}))


def test_every_option_is_classified() -> None:
    """A new field must say whether it changes the vectors: `option(..., fingerprint=...)`."""
    leaves = list(config_fields())
    assert len(leaves) > 40  # the parts were walked into
    unclassified = [".".join(path) for path, f in leaves if not isinstance(f.metadata.get(FINGERPRINT), bool)]
    assert unclassified == []
    with pytest.raises(TypeError):
        option(1)  # type: ignore[call-arg]  # no classification, no field


def test_the_fingerprint_is_the_declared_fields_by_name() -> None:
    paths = fingerprint_fields()
    names = [p[-1] for p in paths]
    assert len(set(names)) == len(names)  # recorded by name: no two may share one
    assert set(RECORDED) <= set(paths)
    cfg = config_of([], Path("/nonexistent/out"))
    assert set(fingerprint(cfg, "float32")) == {*names, "model_stamp"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_the_fingerprint_is_what_earlier_versions_wrote(case: dict[str, Any], tmp_path: Path) -> None:
    cfg = config_of(case["args"], tmp_path / "out")
    cfg = replace(cfg, media=replace(cfg.media, decode=decode_mode(cfg, None)))  # as a new output settles it
    fp = fingerprint(cfg, resolved_dtype(cfg, "cpu"))
    was = recorded_fingerprint(case)  # a local folder was named by its path then, by its content now
    assert {k: v for k, v in fp.items() if k not in ("model", "model_stamp")} == \
        {k: v for k, v in was.items() if k not in ("model", "model_stamp")}
    assert fp["model"] == "local-folder" and fp["model_stamp"].startswith("c2:")
    assert json.loads(json.dumps(fp)) == fp  # what run.json holds, types included (lists, floats)
    assert fingerprint_diff(was, fp, str(DEMO_MODEL)) == []
    assert fingerprint_diff(was, fp) != []  # compared the earlier way only when told the model


@pytest.mark.parametrize("case", [c for c in CASES if c["name"] != "defaults"], ids=lambda c: c["name"])
def test_an_output_with_an_earlier_fingerprint_resumes(case: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["encode", str(MANIFEST), "--out", str(out), "--model", str(DEMO_MODEL), "--workers", "0",
            "--progress", "none", *case["args"]]
    runner = CliRunner()
    assert runner.invoke(app, [*argv, "--limit", "4"], catch_exceptions=False).exit_code == 0
    path = OutDir(out).run_meta_path  # the facts as this version writes them, the fingerprint an earlier one's
    meta = json.loads(path.read_text())
    meta["fingerprint"] = recorded_fingerprint(case)
    path.write_text(json.dumps(meta))
    res = runner.invoke(app, [*argv, "--limit", "6"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "written with other options" not in res.output
    assert json.loads(path.read_text())["fingerprint"] == recorded_fingerprint(case)  # resumed, not rewritten


def test_a_changed_option_still_refuses(tmp_path: Path) -> None:
    case = next(c for c in CASES if c["name"] == "options")
    cfg = config_of([*case["args"], "--text-prefix", "passage: "], tmp_path / "out")
    diff = fingerprint_diff(recorded_fingerprint(case), fingerprint(cfg, "float32"), str(DEMO_MODEL))
    assert diff == ["text_prefix: output has 'query: ', this run 'passage: '"]


def test_required_fields_have_no_default() -> None:
    """Only what every run must name is required; everything else has its one default here."""
    required = {".".join(p) for p, f in config_fields() if f.default is MISSING and f.default_factory is MISSING}
    assert required == {"manifests", "model.model", "writer.out"}
