"""Every item has a deadline, and a stop request is honoured at once: a server that trickles, a
decode that hangs, SIGTERM while a fetch waits, while the model loads or while texts are tokenized."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
from PIL import Image

from mmenc_cli.config import MediaConfig
from mmenc_cli.encoders.base import ImageInput
from mmenc_cli.errors import MMError
from mmenc_cli.media import load_image
from mmenc_cli.run.pipeline import run_encode
from mmenc_cli.stopping import request_stop
from tests.conftest import make_image, write_jsonl
from tests.fakes import FakeEncoder, FakePreprocessor, factory
from tests.runs import embeddings, error_rows, make_cfg

ROOT = Path(__file__).resolve().parents[2]


class Trickle(BaseHTTPRequestHandler):
    """/trickle answers one byte of its status line every 0.3 s; /file redirects to file://."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
            return
        try:
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc":
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.3)
        except OSError:  # the client gave up: that is the point
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_trickling_server_ends_as_a_timeout(server: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(MMError) as err:
        load_image(f"{server}/trickle", ".", MediaConfig(fetch_timeout=1.0, fetch_retries=1), backoff=0.01)
    assert (err.value.code, err.value.reason) == (504, "remote.timeout") and "2 attempts" in err.value.message
    assert time.monotonic() - t0 < 20  # two attempts of about a second each (generous bound)


def test_a_redirect_to_file_is_an_unsupported_scheme(server: str) -> None:
    with pytest.raises(MMError) as err:
        load_image(f"{server}/file", ".", MediaConfig(fetch_timeout=2.0, fetch_retries=0))
    assert (err.value.code, err.value.reason) == (415, "media.unsupported_scheme")


def test_other_items_are_encoded_while_one_fetch_trickles(tmp_path: Path, server: str) -> None:
    rows = [{"id": "slow", "image": f"{server}/trickle"}]
    rows += [{"id": f"i{i}", "image": make_image(tmp_path / f"i{i}.png", seed=i).name} for i in range(24)]
    cfg = make_cfg([write_jsonl(tmp_path / "m.jsonl", rows)], tmp_path / "out", workers=2, batch_size=2)
    cfg = cfg.__class__(**{**cfg.__dict__, "media": MediaConfig(fetch_timeout=3.0, fetch_retries=0)})
    res = run_encode(cfg, encoder_factory=factory(FakeEncoder()))
    assert res.counters.mod("image").encoded == 24 and res.counters.balanced
    assert [(r["id"], r["code"], r["reason"]) for r in error_rows(tmp_path / "out")] == [("slow", 504, "remote.timeout")]


@dataclass
class HangingPreprocessor(FakePreprocessor):
    """Hangs (as a stuck library call would) on images 31 pixels wide."""

    def __call__(self, image: Image.Image) -> ImageInput:
        if image.size[0] == 31:
            time.sleep(120)
        return super().__call__(image)


@dataclass
class HangingEncoder(FakeEncoder):
    def image_preprocessor(self) -> HangingPreprocessor:
        return HangingPreprocessor()


def test_a_decode_that_hangs_passes_its_deadline_and_its_worker_is_replaced(tmp_path: Path) -> None:
    rows = [{"id": f"i{i}", "image": make_image(tmp_path / f"i{i}.png", (31 if i == 3 else 40, 30), seed=i).name}
            for i in range(12)]
    cfg = make_cfg([write_jsonl(tmp_path / "m.jsonl", rows)], tmp_path / "out", workers=2)
    cfg = cfg.__class__(**{**cfg.__dict__, "media": MediaConfig(fetch_timeout=0.5, fetch_retries=0,
                                                                 decode_timeout=1.0)})
    res = run_encode(cfg, encoder_factory=factory(HangingEncoder()))
    assert res.counters.mod("image").encoded == 11 and res.counters.balanced
    assert [(r["id"], r["code"], r["reason"]) for r in error_rows(tmp_path / "out")] == [("i3", 504, "media.timeout")]


def test_a_stop_while_the_model_loads_ends_the_run_at_once(tmp_path: Path) -> None:
    """SIGTERM's handler (`request_stop`) during the model's loading interrupts it there."""
    stop = threading.Event()
    loads = []

    def slow_factory(cfg: Any, device: Any = None) -> FakeEncoder:
        loads.append(1)
        request_stop(stop)  # the signal arrives in the middle of loading
        raise AssertionError("the load went on after the stop request")

    src = write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"text {i}"} for i in range(5)])
    res = run_encode(make_cfg([src], tmp_path / "out"), encoder_factory=slow_factory, stop=stop)
    meta = json.loads((tmp_path / "out" / "_mmenc" / "tasks" / "task-00000.json").read_text())
    assert loads == [1] and res.state == "interrupted" and not res.model_loaded and meta["state"] == "interrupted"
    again = run_encode(make_cfg([src], tmp_path / "out"), encoder_factory=factory(FakeEncoder()))
    assert again.state == "done" and len(embeddings(tmp_path / "out")) == 5


@dataclass
class StoppingTokenizer(FakeEncoder):
    """Its pretokenizer receives a stop request in the middle of a window (as SIGTERM would)."""

    stop: Any = None

    def text_pretokenizer(self, other_thread: bool) -> Any:
        def pretokenize(texts: list[str]) -> list[str]:
            request_stop(self.stop)
            raise AssertionError("tokenizing went on after the stop request")

        return None if other_thread else pretokenize


def test_a_stop_while_a_window_is_tokenized_counts_it_not_attempted(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mmenc_cli.run import texts

    monkeypatch.setattr(texts, "TEXT_WINDOW", 40)
    stop = threading.Event()
    src = write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"text {i}"} for i in range(100)])
    res = run_encode(make_cfg([src], tmp_path / "out", batch_size=4),
                     encoder_factory=factory(StoppingTokenizer(stop=stop)), stop=stop)
    c = res.counters
    assert res.state == "interrupted" and c.balanced and c.mod("text").not_attempted == c.requested > 0
    assert not error_rows(tmp_path / "out")


def mmenc(*args: object) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "mmenc_cli", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, seconds: float = 120) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert time.monotonic() - t0 < seconds, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_while_a_fetch_trickles_commits_what_is_done_and_exits_143(tmp_path: Path, server: str) -> None:
    rows = [{"id": "slow", "image": f"{server}/trickle"}]
    rows += [{"id": f"i{i}", "image": make_image(tmp_path / f"i{i}.png", seed=i).name} for i in range(20)]
    out = tmp_path / "out"
    proc = mmenc("encode", write_jsonl(tmp_path / "m.jsonl", rows), "--out", out, "--workers", "2",
                 "--fetch-timeout", "600", "--fetch-retries", "0", "--batch-size", "4", "--shard-size", "4",
                 "--device", "cpu", "--progress", "none", "--modality", "image")
    wait_for(out / "_mmenc" / "tasks" / "task-00000.json")  # the model is loaded, the run under way
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60 and len(list(out.glob("part-*.parquet"))) < 4:
        time.sleep(0.1)  # the 20 local images are encoded while the fetch trickles
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    meta = json.loads((out / "_mmenc" / "tasks" / "task-00000.json").read_text())
    encoded = meta["counters"]["modalities"]["image"]["encoded"]
    assert meta["state"] == "interrupted" and meta["counters"]["balanced"]
    # all but the slow item's chunk-mates (decoded in one worker call with it) and a last short batch
    assert encoded >= 16 and meta["counters"]["not_attempted"] == 21 - encoded
    assert len(embeddings(out)) == encoded  # whole shards committed


@pytest.mark.slow
def test_a_second_sigint_still_records_the_task_as_interrupted(tmp_path: Path) -> None:
    rows = [{"id": f"t{i}", "text": f"text number {i} " * 20} for i in range(20000)]
    out = tmp_path / "out"
    proc = mmenc("encode", write_jsonl(tmp_path / "m.jsonl", rows), "--out", out, "--device", "cpu",
                 "--progress", "none")
    wait_for(out / "_mmenc" / "tasks" / "task-00000.json")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert json.loads((out / "_mmenc" / "tasks" / "task-00000.json").read_text())["state"] == "interrupted"


@pytest.mark.slow
def test_sigterm_while_the_model_loads_exits_143_at_once(tmp_path: Path, tiny_st: Path) -> None:
    """The lock is taken right before the model loads (importing torch takes seconds): SIGTERM
    then ends the run there, with 143, the task interrupted and no model loaded."""
    out = tmp_path / "out"
    src = write_jsonl(tmp_path / "m.jsonl", [{"id": f"t{i}", "text": f"text {i}"} for i in range(50)])
    proc = mmenc("encode", src, "--out", out, "--model", tiny_st, "--device", "cpu", "--progress", "none")
    wait_for(out / "_mmenc" / "locks" / "task-00000.lock", seconds=60)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    meta = json.loads((out / "_mmenc" / "tasks" / "task-00000.json").read_text())
    assert meta["state"] == "interrupted" and meta["model_loaded"] is False and meta["counters"]["balanced"]
