"""Every store call bounded: a connect and a read timeout and a bounded number of attempts
(`objectstore.client_options`), so an endpoint that accepts connections and never answers is exit 3
naming it; a stop request ends a wait on the store within seconds (`stopping.bounded`), exit 143.
Against a listening socket that never answers, and a proxy to the S3 server that goes silent mid-run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from mmenc_cli import stopping
from mmenc_cli.errors import ConfigError
from mmenc_cli.output.objectstore import client_options
from tests.s3server import bucket, s3_server, store_env  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


class Silent:
    """A TCP endpoint on 127.0.0.1: connections to `target` are relayed both ways until `silent`
    is set; from then on (and always, with no target) nothing more is relayed or answered."""

    def __init__(self, target: tuple[str, int] | None = None) -> None:
        self.target, self.silent, self.accepted = target, threading.Event(), 0
        if target is None:
            self.silent.set()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)
            if self.target is not None and not self.silent.is_set():
                up = socket.create_connection(self.target)
                self.held.append(up)
                for a, b in ((conn, up), (up, conn)):
                    threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while (data := src.recv(65536)) and not self.silent.is_set():
                dst.sendall(data)
        except OSError:
            pass  # the run's side went away: nothing to relay

    def close(self) -> None:
        self.sock.close()
        for s in self.held:
            s.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    endpoint = Silent()
    yield endpoint
    endpoint.close()


def texts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": f"text number {i}"}) + "\n" for i in range(n)))
    return path


def start(manifest: Path, out: str, endpoint: str, **env: str) -> subprocess.Popen:
    """`mmenc encode` of texts into `out`, its store calls going to `endpoint`."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **store_env(endpoint), **env}
    args = [sys.executable, "-m", "mmenc_cli", "encode", str(manifest), "--out", out, "--modality", "text",
            "--shard-size", "40", "--progress", "none", "--workers", "0"]
    return subprocess.Popen(args, env=full, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(what: Any, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.1)


# -- the client's options ----------------------------------------------------------------------

def test_every_s3_call_has_timeouts_and_bounded_attempts_under_the_users_options(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MMENC_STORE_CONNECT_TIMEOUT", "MMENC_STORE_READ_TIMEOUT", "MMENC_STORE_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    config = client_options("s3")["config_kwargs"]
    assert config["connect_timeout"] > 0 and config["read_timeout"] > 0
    assert config["retries"]["mode"] == "standard" and 1 <= config["retries"]["total_max_attempts"] <= 5
    # five s3fs tries of a call, each of these attempts, each at most the read timeout: about two minutes
    assert 5 * config["retries"]["total_max_attempts"] * config["read_timeout"] <= 150
    mine = client_options("s3", {"config_kwargs": {"read_timeout": 99}, "endpoint_url": "http://x"})
    assert mine["config_kwargs"]["read_timeout"] == 99 and mine["endpoint_url"] == "http://x"
    assert mine["config_kwargs"]["connect_timeout"] == config["connect_timeout"]  # the rest stays bounded
    monkeypatch.setenv("MMENC_STORE_READ_TIMEOUT", "2.5")
    monkeypatch.setenv("MMENC_STORE_ATTEMPTS", "1")
    assert client_options("s3a")["config_kwargs"]["read_timeout"] == 2.5
    assert client_options("s3")["config_kwargs"]["retries"]["total_max_attempts"] == 1
    assert set(client_options("az")) == {"connection_timeout", "read_timeout"}
    assert client_options("gs", {"project": "p"}) == {"project": "p"}  # gcsfs: its own bounds
    monkeypatch.setenv("MMENC_STORE_READ_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="MMENC_STORE_READ_TIMEOUT"):
        client_options("s3")


def test_a_wait_on_the_store_ends_a_grace_after_a_stop_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stopping, "_requested", [])
    monkeypatch.setattr(stopping, "_cut", [])
    monkeypatch.setenv("MMENC_STOP_GRACE", "0.5")
    assert stopping.bounded(lambda: 7, "a call") == 7
    with pytest.raises(KeyError):
        stopping.bounded(lambda: {}["x"], "a call")  # the call's own error, as it is
    never = threading.Event()
    stop = threading.Event()
    threading.Timer(0.3, stopping.request_stop, (stop, signal.SIGINT)).start()
    with pytest.raises(stopping.StopWait, match="writing x"):
        stopping.bounded(never.wait, "writing x")
    assert stop.is_set() and stopping.cut_short() == ["writing x"] and stopping.stop_exit_code() == 130
    never.set()


# -- a store that never answers ----------------------------------------------------------------

@pytest.mark.slow
def test_an_endpoint_that_never_answers_is_exit_3_naming_it(tmp_path: Path, silent: Silent) -> None:
    run = start(texts(tmp_path / "m.jsonl", 20), "s3://b/emb", silent.url,
                MMENC_STORE_READ_TIMEOUT="1", MMENC_STORE_ATTEMPTS="1")
    _, err = run.communicate(timeout=300)
    assert run.returncode == 3, err
    assert silent.url in err and "did not answer" in err and "Traceback" not in err
    assert silent.accepted >= 1


@pytest.mark.slow
def test_sigterm_while_the_store_never_answers_exits_143(tmp_path: Path, silent: Silent) -> None:
    run = start(texts(tmp_path / "m.jsonl", 20), "s3://b/emb", silent.url, MMENC_STOP_GRACE="2")
    wait_until(lambda: silent.accepted >= 1)  # the run waits on the store (default bounds: minutes)
    time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)  # a guard against a hang, not a measure of speed
    assert run.returncode == 143, err
    assert "stopped while waiting for the store" in err and "Traceback" not in err


@pytest.mark.slow
def test_sigterm_mid_run_with_the_store_gone_silent_exits_143_with_whole_shards(tmp_path: Path, bucket: str,
                                                                                s3_server: str) -> None:
    import s3fs

    from mmenc_cli.output.embeddings import read_embeddings

    host, port = s3_server.split("//", 1)[1].split(":")
    relay = Silent((host, int(port)))
    try:
        run = start(texts(tmp_path / "m.jsonl", 3000), f"s3://{bucket}/emb", relay.url, MMENC_STOP_GRACE="2")
        fs = s3fs.S3FileSystem()
        wait_until(lambda: len(fs.glob(f"{bucket}/emb/part-*.parquet", refresh=True)) >= 2)
        relay.silent.set()  # from here the store accepts and never answers: commits, flushes, the record
        time.sleep(1.0)
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=60)
    finally:
        relay.close()
    assert run.returncode == 143, err
    assert "Traceback" not in err
    ids, matrix = read_embeddings(f"s3://{bucket}/emb", "text")  # what is there is whole and readable
    assert len(ids) == len(set(ids)) and len(ids) % 40 == 0 and matrix.shape[0] == len(ids)
