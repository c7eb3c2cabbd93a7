"""A real S3 API server on localhost for the tests (moto in server mode), and a small HTTP proxy in
front of it that injects what real stores do: 503 SlowDown, 403 AccessDenied on writes, and a store
without conditional writes (it drops `If-None-Match`).

`.ci/run` starts the server and exports MMENC_TEST_S3 (its URL); without it the session starts its
own on a free port.
"""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from contextlib import contextmanager
from typing import Iterator

import pytest

KEY_ID, SECRET = "mmenc-test-key", "mmenc-test-secret-do-not-leak"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(port: int, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"no server on port {port}")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The S3 API server's URL (moto in server mode)."""
    given = os.environ.get("MMENC_TEST_S3")
    if given:
        yield given
        return
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def store_env(endpoint: str) -> dict[str, str]:
    """The standard credential chain's variables, pointed at `endpoint`."""
    return {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": endpoint,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture
def bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the server, with this process's credentials pointed at it; its name."""
    for key, value in store_env(s3_server).items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    name = f"b{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    return name


class _Proxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, target: str, mode: str, count: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.target = urllib.parse.urlparse(target)
        self.mode, self.left, self.injected = mode, count, 0
        self.lock = threading.Lock()

    def inject(self, method: str) -> bool:
        if method not in ("PUT", "POST", "DELETE"):
            return False
        with self.lock:
            if self.mode == "readonly":
                self.injected += 1
                return True
            if self.mode == "slowdown" and self.left > 0:
                self.left -= 1
                self.injected += 1
                return True
        return False


_ERRORS = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
           "readonly": (403, "AccessDenied", "Access Denied")}


def send_error_xml(handler: http.server.BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
    """Answer as S3 answers an error: `status` with its XML body."""
    xml = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(xml)))
    handler.end_headers()
    handler.wfile.write(xml)


def relay(handler: http.server.BaseHTTPRequestHandler, target: urllib.parse.ParseResult, body: bytes,
          headers: dict[str, str]) -> None:
    """Send the request to `target` and its answer back, whole (one Content-Length)."""
    conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
    conn.request(handler.command, handler.path, body=body, headers=headers)
    answer = conn.getresponse()
    data = answer.read()
    handler.send_response(answer.status)
    for key, value in answer.getheaders():
        if key.lower() not in ("transfer-encoding", "connection", "content-length"):
            handler.send_header(key, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
    conn.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.server.inject(self.command):
            send_error_xml(self, *_ERRORS[self.server.mode])
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
        if self.server.mode == "no-exclusive":
            headers = {k: v for k, v in headers.items() if k.lower() != "if-none-match"}
        relay(self, self.server.target, body, headers)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


@contextmanager
def proxy(target: str, mode: str, count: int = 0) -> Iterator[_Proxy]:
    """A proxy to `target` injecting `mode`: "slowdown" (503 to the first `count` writes),
    "readonly" (403 to every write), "no-exclusive" (If-None-Match dropped)."""
    server = _Proxy(target, mode, count)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
