"""Answers that are not what they claim, from a loopback server: headers that trickle in past
the fetch's deadline end as a timeout (not as an empty file), and a body shorter than its
Content-Length is a truncated file naming the short read (not an empty one)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from mmenc_cli.config import MediaConfig
from mmenc_cli.errors import MMError
from mmenc_cli.media import load_clip, load_image
from tests.media.test_media import png

BODY = png((9, 5), (255, 0, 0))


class _Answers(BaseHTTPRequestHandler):
    """/headers: the status line, then one header line every `GAP` s (`LINES` of them), then a
    complete image; /short: a Content-Length of 1000 and 50 bytes, then the connection closes."""

    protocol_version = "HTTP/1.1"
    hits: Counter = Counter()
    GAP, LINES = 0.4, 10

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self.hits[self.path] += 1
        try:
            if self.path.startswith("/headers"):
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                for k in range(self.LINES):
                    self.wfile.flush()
                    time.sleep(self.GAP)
                    self.wfile.write(f"X-Slow-{k}: {k}\r\n".encode())
                self.wfile.write(b"Content-Type: image/png\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
            else:
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n" + BODY[:50])
                self.close_connection = True
            self.wfile.flush()
        except OSError:  # the client gave up: that is the point
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def error_of(fn, *args, **kwargs) -> MMError:  # type: ignore[no-untyped-def]
    with pytest.raises(MMError) as info:
        fn(*args, **kwargs)
    return info.value


def test_headers_trickling_past_the_deadline_are_a_timeout(server: str) -> None:
    cfg = MediaConfig(fetch_timeout=1.0, fetch_retries=1)
    t0 = time.monotonic()
    err = error_of(load_image, f"{server}/headers?t=image", ".", cfg, backoff=0.01)
    assert (err.code, err.reason, err.stage) == (504, "remote.timeout", "load"), err
    assert "2 attempts" in err.message
    assert time.monotonic() - t0 < 3 * _Answers.GAP * _Answers.LINES  # about 2 x 1 s, not the headers' 4 s each
    assert _Answers.hits["/headers?t=image"] == 2


def test_a_clips_headers_trickling_past_the_deadline_are_a_timeout(server: str) -> None:
    pytest.importorskip("av")
    from mmenc_cli.media.video import decode_frames

    cfg = MediaConfig(fetch_timeout=1.0, fetch_retries=0).limit_bytes("video")
    err = error_of(lambda: decode_frames(load_clip(f"{server}/headers?t=clip", ".", cfg, backoff=0.01), 4, None,
                                         3600.0, cfg.max_image_pixels))
    assert (err.code, err.reason, err.stage) == (504, "remote.timeout", "load"), err


def test_a_body_shorter_than_its_content_length_names_the_short_read(server: str) -> None:
    err = error_of(load_image, f"{server}/short?t=1", ".", MediaConfig(fetch_timeout=2.0, fetch_retries=1),
                   backoff=0.01)
    assert (err.code, err.reason, err.stage) == (400, "media.unreadable", "load"), err
    assert "got 50 of 1000 bytes" in err.message and "empty" not in err.message
    assert _Answers.hits["/short?t=1"] == 2  # retried once: a dropped connection may come back whole
