"""Read-only commands on an output in a store that fails them (credentials missing or refused, a
missing bucket, an endpoint that cannot be reached) exit 3 with the store's own reason in one line,
like `encode`: never "internal error", never a traceback. Against the S3 server (a proxy in front of
it refuses keys that are not the test's, as a real store does)."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path
from typing import Iterator

import pytest

from tests.s3server import KEY_ID, bucket, free_port, relay, s3_server, send_error_xml, store_env  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

COMMANDS = [["status"], ["inspect"], ["errors", "summary"], ["errors", "list"], ["errors", "retry", "{out}", "-o",
            "{tmp}/retry.jsonl"], ["export", "vllm", "{out}", "{tmp}/dest"]]


class _Checking(http.server.BaseHTTPRequestHandler):
    """Forwards to the S3 server what is signed with the test's key id; answers anything else
    with S3's 403 InvalidAccessKeyId."""

    protocol_version = "HTTP/1.1"
    target: urllib.parse.ParseResult

    def log_message(self, *args: object) -> None:
        pass

    def _handle(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if f"Credential={KEY_ID}/" not in (self.headers.get("Authorization") or ""):
            send_error_xml(self, 403, "InvalidAccessKeyId",
                           "The AWS Access Key Id you provided does not exist in our records.")
            return
        relay(self, self.target, body, dict(self.headers.items()))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


@pytest.fixture
def checking(s3_server: str) -> Iterator[str]:
    handler = type("Handler", (_Checking,), {"target": urllib.parse.urlparse(s3_server)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def mmenc(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": env.pop("HOME", os.environ.get("HOME", "")), **env}
    return subprocess.run([sys.executable, "-m", "mmenc_cli", *args], capture_output=True, text=True, env=full,
                          cwd=ROOT, timeout=300)


def command(words: list[str], out: str, tmp: Path) -> list[str]:
    args = [w.format(out=out, tmp=tmp) for w in words]
    return args if "{out}" in words else [*args, out]


def assert_store_fault(done: subprocess.CompletedProcess, *said: str) -> None:
    err = done.stderr.strip()
    assert done.returncode == 3, err
    assert "internal error" not in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("mmenc: error:")]) == 1, err
    assert any(s.lower() in err.lower() for s in said), err


@pytest.fixture
def output(tmp_path: Path, bucket: str, s3_server: str) -> str:
    """An output in the bucket (a few texts, one of them failing)."""
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": ""}\n{"id": "c", "text": "three"}\n')
    out = f"s3://{bucket}/emb"
    done = mmenc(["encode", str(manifest), "--out", out, "--modality", "text", "--progress", "none", "--workers",
                  "0"], store_env(s3_server))
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: " ".join(w[:2]))
def test_store_faults_are_exit_3_with_the_store_s_reason(words: list[str], output: str, s3_server: str,
                                                        checking: str, tmp_path: Path) -> None:
    args = command(words, output, tmp_path)
    ok = store_env(s3_server)
    no_keys = {k: v for k, v in ok.items() if not k.startswith("AWS_ACCESS") and not k.startswith("AWS_SECRET")}
    missing = {k: "" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    assert_store_fault(mmenc(args, {**no_keys, **missing, "HOME": str(tmp_path), "AWS_SHARED_CREDENTIALS_FILE":
                                    str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")}),
                       "credentials")
    wrong = {**ok, "AWS_ACCESS_KEY_ID": "not-the-key", "AWS_ENDPOINT_URL": checking}
    assert_store_fault(mmenc(args, wrong), "Access Key Id", "InvalidAccessKeyId", "denied", "forbidden")
    unreachable = {**ok, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    assert_store_fault(mmenc(args, unreachable), unreachable["AWS_ENDPOINT_URL"])
    gone = command(words, output.replace(output.split("/")[2], "no-such-bucket-mmenc"), tmp_path)
    # export reads run.json only: a missing bucket is "not a --pooling tokens output" there (exit 3 too)
    assert_store_fault(mmenc(gone, ok), "no such", "does not exist", "NoSuchBucket", "not an mmenc output",
                       "not a --pooling tokens output")
