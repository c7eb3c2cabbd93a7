"""Every command opens a bucket the way `encode` does: `status`, `inspect`, `errors summary|list|retry`
and `export vllm` take `--storage-option KEY=VALUE`, and `read_embeddings` takes `storage_options`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mmenc_cli.output.embeddings import read_embeddings
from tests.output.test_store import encode, mmenc, texts
from tests.s3server import KEY_ID, SECRET, bucket, s3_server  # noqa: F401

pytestmark = pytest.mark.slow
CHAIN = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")


def test_read_only_commands_take_storage_options(tmp_path: Path, bucket: str, s3_server: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = f"s3://{bucket}/emb"
    assert encode(texts(tmp_path / "m.jsonl", 60, empty_every=20), out, endpoint=s3_server).returncode == 0
    for name in CHAIN:  # from here on the credentials come only from the options
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    options = ["--storage-option", f"key={KEY_ID}", "--storage-option", f"secret={SECRET}",
               "--storage-option", f"endpoint_url={s3_server}"]
    commands = [("status", out), ("inspect", out), ("errors", "summary", out), ("errors", "list", out),
                ("errors", "retry", out, "-o", tmp_path / "retry.jsonl")]
    for command in commands:
        done = mmenc(*command, *options)
        assert done.returncode == 0, (command, done.stderr)
    assert len((tmp_path / "retry.jsonl").read_text().splitlines()) == 3
    summary = json.loads(mmenc("errors", "summary", out, "--json", *options).stdout)
    assert summary["errors"] == 3
    without = mmenc("status", out)
    assert without.returncode == 3 and "internal error" not in without.stderr
    exported = mmenc("export", "vllm", out, tmp_path / "vllm", *options)
    assert exported.returncode == 3 and "tokens" in exported.stderr  # read the bucket: it holds pooled vectors
    ids, matrix = read_embeddings(out, "text", storage_options={"key": KEY_ID, "secret": SECRET,
                                                               "endpoint_url": s3_server})
    assert len(ids) == 57 and matrix.shape[0] == 57
    assert os.environ.get("AWS_ACCESS_KEY_ID") is None
