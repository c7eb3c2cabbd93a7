"""An offline node: a hub id that is not cached is one line saying what to do, at once, instead of
the hub client's minute of retries; a cached one loads from the cache; HF_HUB_OFFLINE=1 asks nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mmenc_cli.encoders import hub
from mmenc_cli.errors import ModelLoadError

ROOT = Path(__file__).resolve().parents[2]


def closed_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed


@pytest.fixture
def no_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", closed_endpoint())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "cache"


def test_an_uncached_model_is_one_line_with_what_to_do(no_hub: Path) -> None:
    with pytest.raises(ModelLoadError) as err:
        hub.check_hub("someorg/some-model", None)
    text = str(err.value)
    assert "cannot be reached" in text and "not in the local cache" in text
    assert "huggingface-cli download someorg/some-model" in text and "HF_HUB_OFFLINE=1" in text
    assert "\n" not in text


def test_a_cached_model_loads_from_the_cache(no_hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = no_hub / "models--someorg--cached" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (no_hub / "models--someorg--cached" / "refs").mkdir()
    (no_hub / "models--someorg--cached" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "")
    hub.check_hub("someorg/cached", None)
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def test_offline_asked_or_a_reachable_hub_is_left_alone(no_hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.check_hub("someorg/some-model", None)  # the user asked for the cache: transformers says the rest
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        hub.check_hub("someorg/some-model", None)  # reachable: the hub client downloads as usual


def test_encode_on_an_offline_node_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a", "text": "hello"}\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": closed_endpoint(),
           "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": ""}
    done = subprocess.run([sys.executable, "-m", "mmenc_cli", "encode", str(manifest), "--out", str(tmp_path / "out"),
                           "--model", "someorg/some-model", "--workers", "0", "--progress", "none"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 3
    assert "cannot be reached" in done.stderr and "Retrying" not in done.stderr
    assert not (tmp_path / "out").exists()  # a failed start leaves nothing
