"""An output knows a local model folder by what it holds: the same files at another path resume,
retrained weights of the same size are refused (exit 3 naming the model), a README beside the
weights changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.cli.encode import DEMO_MODEL
from mmenc_cli.run.model_identity import WHOLE, content_stamp, legacy_stamp

runner = CliRunner()


def encode(manifest: Path, out: Path, model: Path) -> tuple[int, dict]:
    res = runner.invoke(app, ["encode", str(manifest), "--out", str(out), "--model", str(model), "--workers", "0",
                              "--progress", "none", "--modality", "text", "--json"])
    try:
        return res.exit_code, json.loads(res.stdout)
    except ValueError:
        return res.exit_code, {"output": res.output}


def retrain(folder: Path) -> None:
    """New weights in place, the header and the size kept, as a second training of one shape gives."""
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # the tensors' bytes follow the JSON header
    noise = np.random.default_rng(7).normal(0, 0.02, (len(data) - start) // 4).astype(np.float32)
    data[start:start + noise.nbytes] = noise.tobytes()
    path.write_bytes(bytes(data))


def test_a_moved_model_resumes_and_retrained_weights_are_refused(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(12)))
    first, moved = tmp_path / "shared" / "model", tmp_path / "node-local" / "copy-of-it"
    shutil.copytree(DEMO_MODEL, first)
    out = tmp_path / "out"
    code, _ = encode(manifest, out, first)
    assert code == 0
    shutil.copytree(first, moved)
    (moved / "README.md").write_text("notes that are not the model")
    shutil.rmtree(first)  # the folder is gone from where the output was started
    with manifest.open("a") as fh:
        fh.write(json.dumps({"id": "new", "text": "a new row"}) + "\n")
    code, result = encode(manifest, out, moved)
    assert code == 0, result
    text = result["counters"]["modalities"]["text"]
    assert text["encoded_before"] == 12 and text["encoded"] == 1
    retrain(moved)
    code, result = encode(manifest, out, moved)
    assert code == 3
    assert f"model {moved}: its files are not those the output was written with" in result["output"]


def test_the_stamp_samples_large_files_and_ignores_what_is_not_the_model(tmp_path: Path) -> None:
    a = tmp_path / "a"
    (a / "1_Pooling").mkdir(parents=True)
    (a / "config.json").write_text('{"hidden_size": 8}')
    (a / "1_Pooling" / "config.json").write_text('{"mode": "mean"}')
    weights = np.random.default_rng(0).integers(0, 255, 3 * WHOLE, dtype=np.uint8)
    (a / "model.safetensors").write_bytes(weights.tobytes())
    stamp = content_stamp(a)
    (a / "README.md").write_text("edited")
    (a / ".cache").mkdir()
    (a / ".cache" / "x.json").write_text("{}")
    assert content_stamp(a) == stamp
    b = tmp_path / "elsewhere"
    shutil.copytree(a, b)
    assert content_stamp(b) == stamp
    (b / "1_Pooling" / "config.json").write_text('{"mode": "cls"}')  # a file in a subfolder counts
    assert content_stamp(b) != stamp
    changed = weights.copy()
    changed[:] = np.random.default_rng(1).integers(0, 255, changed.size, dtype=np.uint8)  # retrained: everywhere
    (a / "model.safetensors").write_bytes(changed.tobytes())
    assert content_stamp(a) != stamp
    assert legacy_stamp(a) == legacy_stamp(tmp_path / "elsewhere")  # the old stamp saw sizes only
