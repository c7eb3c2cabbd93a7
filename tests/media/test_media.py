"""Tests for mmenc_cli.media: every fault's code/reason/stage, every good case's RGB output, HTTP
retries against a loopback server, and the limits."""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from PIL import AvifImagePlugin, Image, WebPImagePlugin

from mmenc_cli.media import sources as media_sources
from mmenc_cli.config import MediaConfig
from mmenc_cli.errors import REASONS, MMError
from mmenc_cli.media import configure_pillow, describe_source, load_image

from tests.faults import GOOD_SIZES, build_fault_corpus, build_good_corpus, png_bytes

FAULT_NAMES = [
    "truncated_jpeg", "empty_file", "not_an_image", "corrupt_png", "bad_crc_png",
    "decompression_bomb", "heic_without_plugin", "svg", "directory", "missing",
    "path_through_file", "bad_base64", "bad_data_uri", "data_uri_not_image", "empty_data_uri",
    "ftp_scheme", "store_without_backend", "refused", "permission_denied",
]
FAST = MediaConfig(fetch_timeout=0.5, fetch_retries=1)
BACKOFF = 0.01


def png(size: tuple[int, int] = (6, 4), color: tuple[int, int, int] = (0, 200, 0)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def fails(source, cfg: MediaConfig = FAST, base_dir: str = ".") -> MMError:
    """Load `source`, expecting an MMError; return it after checking it is well-formed."""
    with pytest.raises(MMError) as info:
        load_image(source, base_dir, cfg, backoff=BACKOFF)
    err = info.value
    assert err.reason in REASONS and err.code == REASONS[err.reason][0]
    assert err.message and err.error
    return err


def outcome(err: MMError) -> tuple[int, str, str]:
    return err.code, err.reason, err.stage


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loopback requests must not go through a proxy from the environment."""
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def fault_corpus(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("faults")
    return root, build_fault_corpus(root)


@pytest.fixture(scope="module")
def good_corpus(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("good")
    return root, build_good_corpus(root)


# --------------------------------------------------------------------------------------------
# Corpora


def test_fault_names_cover_the_corpus(fault_corpus) -> None:
    assert set(fault_corpus[1]) <= set(FAULT_NAMES)


@pytest.mark.parametrize("name", FAULT_NAMES)
def test_fault_case(name: str, fault_corpus) -> None:
    root, cases = fault_corpus
    if name not in cases:
        pytest.skip("permission_denied cannot be built as root (see test_permission_denied)")
    case = cases[name]
    err = fails(case.source, base_dir=str(root))
    assert outcome(err) == (case.code, case.reason, case.stage), err.message


@pytest.mark.parametrize("name", sorted(GOOD_SIZES))
def test_good_case(name: str, good_corpus) -> None:
    root, sources = good_corpus
    im = load_image(sources[name], str(root), FAST)
    assert im.mode == "RGB" and im.size == GOOD_SIZES[name]
    assert type(im) is Image.Image  # detached from the file reader, fully loaded
    np.asarray(im)


def test_good_conversions(good_corpus) -> None:
    root, sources = good_corpus

    def px(name: str, xy: tuple[int, int]) -> tuple[int, ...]:
        return load_image(sources[name], str(root), FAST).getpixel(xy)

    assert px("rgba_png", (2, 2)) == (255, 0, 0) and px("rgba_png", (12, 2)) == (255, 255, 255)
    assert px("la_png", (2, 2)) == (40, 40, 40) and px("la_png", (12, 2)) == (255, 255, 255)
    assert px("palette_png", (15, 5)) == (0, 0, 0)  # colour 0 without transparency stays black
    assert px("palette_transparent_png", (15, 5)) == (255, 255, 255)
    assert px("palette_transparent_png", (2, 2)) == (200, 0, 0)
    gray16 = np.asarray(load_image(sources["gray16_png"], str(root), FAST))[0, :, 0]
    assert gray16[0] == 0 and gray16[-1] == 255 and 120 <= gray16[32] <= 135  # scaled, not clipped
    assert np.all(np.diff(gray16.astype(int)) >= 0) and len(set(gray16)) > 50
    assert px("rgb16_png", (0, 0)) == (128, 255, 0)
    assert px("one_bit_png", (0, 0)) == (255, 255, 255) and px("one_bit_png", (8, 6)) == (0, 0, 0)
    red, green = px("exif_rotated_jpeg", (10, 5)), px("exif_rotated_jpeg", (10, 35))
    assert red[0] > 200 and red[1] < 60 and green[1] > 100 and green[0] < 60  # upright: red on top
    r, g, b = px("cmyk_jpeg", (5, 5))
    assert r > 200 and g < 60 and b < 60
    assert px("animated_gif", (5, 5)) == (255, 0, 0)  # first frame
    assert px("multipage_tiff", (5, 5)) == (10, 20, 30)  # first page
    assert px("data_uri_png", (0, 0)) == (0, 0, 255)


# --------------------------------------------------------------------------------------------
# Local files, file:// and data: URIs


def test_relative_path_resolves_against_base_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(png())
    monkeypatch.chdir("/")
    assert load_image("sub/a.png", str(tmp_path), FAST).size == (6, 4)
    assert load_image(str(tmp_path / "sub" / "a.png"), "/nonexistent", FAST).size == (6, 4)
    assert outcome(fails("a.png", base_dir=str(tmp_path))) == (404, "media.not_found", "load")


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "h.png").write_bytes(png())
    assert load_image("~/h.png", "/nonexistent", FAST).size == (6, 4)


def test_file_url_is_percent_decoded(tmp_path: Path) -> None:
    path = tmp_path / "with space é%.png"
    path.write_bytes(png())
    url = "file://" + urllib.parse.quote(str(path))
    assert load_image(url, "/nonexistent", FAST).size == (6, 4)
    assert load_image("file://localhost" + urllib.parse.quote(str(path)), ".", FAST).size == (6, 4)
    assert outcome(fails("file://otherhost/x.png")) == (400, "media.invalid_source", "load")


def test_file_size_limit_checked_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.png").write_bytes(png((64, 64)))
    small = MediaConfig(max_file_bytes=100)
    monkeypatch.setattr(media_sources, "open", lambda *a, **k: pytest.fail("read despite size"), raising=False)
    assert outcome(fails("a.png", small, str(tmp_path))) == (413, "media.file_too_large", "load")
    assert outcome(fails(png((64, 64)), small)) == (413, "media.file_too_large", "load")
    big_uri = "data:image/png;base64," + base64.b64encode(png((64, 64))).decode()
    assert outcome(fails(big_uri, small)) == (413, "media.file_too_large", "load")


def test_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.png").write_bytes(png())

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(media_sources, "open", denied, raising=False)  # works as root too
    err = fails("a.png", base_dir=str(tmp_path))
    assert outcome(err) == (403, "media.permission_denied", "load") and err.error == "PermissionError"


def test_data_uris() -> None:
    payload = base64.b64encode(png()).decode()
    assert load_image(f"data:image/png;base64,{payload}", ".", FAST).size == (6, 4)
    # Untyped payloads are sniffed; URL-safe alphabet, missing padding and line breaks tolerated.
    assert load_image(f"data:;base64,{payload}", ".", FAST).size == (6, 4)
    loose = base64.urlsafe_b64encode(png((7, 3))).decode().rstrip("=")
    loose = "\n".join(loose[i:i + 60] for i in range(0, len(loose), 60))
    assert load_image(f"data:image/png;base64,{loose}", ".", FAST).size == (7, 3)
    assert outcome(fails("data:image png;base64,AAAA")) == (400, "media.bad_data_uri", "load")
    assert outcome(fails("data:image/png;base64,AAAAA")) == (400, "media.bad_base64", "load")
    svg = "data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg'/%3E"
    assert outcome(fails(svg)) == (415, "media.unsupported_format", "decode")


@pytest.mark.parametrize("source", [None, 5, "", "   ", ["a.png"]])
def test_invalid_source(source) -> None:
    assert outcome(fails(source)) == (400, "media.invalid_source", "load")


def test_unsupported_scheme_names_the_supported_ones() -> None:
    err = fails("gs://bucket/x.jpg")
    assert outcome(err) == (415, "media.unsupported_scheme", "load")
    assert "gs://" in err.message and "https://" in err.message and "data:" in err.message


# --------------------------------------------------------------------------------------------
# Pixel limits and decoder failures


def test_pixel_limit_from_header_before_decoding() -> None:
    cfg = MediaConfig(max_image_pixels=100)
    err = fails(png((20, 20)), cfg)
    assert outcome(err) == (413, "media.too_large", "decode") and "400" in err.message
    # Cut inside IDAT: decoding would say "truncated"; the header check says too large first.
    header_only = png_bytes(1000, 1000, 8, 2, b"\0" * 3_001_000)[:60]
    assert outcome(fails(header_only, cfg)) == (413, "media.too_large", "decode")
    assert load_image(png((10, 10)), ".", cfg).size == (10, 10)  # exactly at the limit


def test_configure_pillow_makes_the_config_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    cfg = MediaConfig(max_image_pixels=10_000)
    assert outcome(fails(png((30, 30)), cfg)) == (413, "media.too_large", "decode")  # Pillow's bomb check
    configure_pillow(cfg)
    assert Image.MAX_IMAGE_PIXELS == 10_000
    assert load_image(png((30, 30)), ".", cfg).size == (30, 30)


def test_missing_decoder_is_our_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_decoder(mode, decoder_name, *args):
        raise OSError(f"decoder {decoder_name} not available")

    monkeypatch.setattr(Image, "_getdecoder", no_decoder)
    err = fails(png())
    assert outcome(err) == (500, "media.decoder_missing", "decode") and err.error == "OSError"


@pytest.mark.filterwarnings("ignore:image file could not be identified")
def test_missing_plugin_support(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, "WEBP")
    monkeypatch.setattr(WebPImagePlugin, "SUPPORTED", False)
    assert outcome(fails(buf.getvalue())) == (500, "media.decoder_missing", "decode")  # expected codec
    avif = b"\0\0\0\x1cftypavif\0\0\0\0avifmif1miaf" + b"\0" * 64
    monkeypatch.setattr(AvifImagePlugin, "SUPPORTED", False)
    assert outcome(fails(avif)) == (415, "media.unsupported_format", "decode")


def test_unexpected_exceptions_become_mmerrors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(Image, "open", boom)
    err = fails(png())
    assert outcome(err) == (500, "internal", "decode") and err.error == "RuntimeError"
    monkeypatch.setattr(media_sources.os, "stat", boom)
    err = fails(str(tmp_path / "a.png"))
    assert outcome(err) == (500, "internal", "load") and err.error == "RuntimeError"
    assert pickle.loads(pickle.dumps(err)).reason == "internal"  # crosses worker processes


# --------------------------------------------------------------------------------------------
# HTTP against a loopback server


class _Handler(BaseHTTPRequestHandler):
    """Routes named for what they do; `hits` counts requests per full path (query included), so
    tests use their own query string and never share a counter."""

    hits: Counter = Counter()
    image = png((9, 5), (255, 0, 0))

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", ctype: str = "image/png", **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        if "Content_Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.hits[self.path] += 1
        first = self.hits[self.path] == 1
        route = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        if route in ("/ok.png", "/ünï code.png"):
            self._send(200, self.image)
        elif route in ("/missing", "/gone", "/forbidden", "/unauth", "/teapot", "/down"):
            status = {"/missing": 404, "/gone": 410, "/forbidden": 403, "/unauth": 401,
                      "/teapot": 418, "/down": 503}[route]
            self._send(status, b"no", "text/plain")
        elif route == "/flaky":
            self._send(500, b"oops", "text/plain") if first else self._send(200, self.image)
        elif route == "/ratelimited":
            wait = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["wait"][0]
            self._send(429, b"slow down", "text/plain", Retry_After=wait) if first \
                else self._send(200, self.image)
        elif route == "/slow":
            time.sleep(1.0)
            self._send(200, self.image)
        elif route == "/dribble":
            self.send_response(200)
            self.send_header("Content-Length", "200")
            self.end_headers()
            for _ in range(200):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.02)
        elif route == "/big":
            self._send(200, b"\0" * 5000)
        elif route == "/big-stream":  # no Content-Length: HTTP/1.0 body ends at close
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\0" * 5000)
        elif route == "/short":
            self._send(200, self.image[:50], Content_Length=str(len(self.image)))
        elif route == "/html":
            self._send(200, b"<!DOCTYPE html><html>soft 404</html>", "text/html; charset=utf-8")
        elif route == "/redirect":
            self._send(302, b"", "text/plain", Location="/ok.png")
        elif route == "/redirect-ftp":
            self._send(302, b"", "text/plain", Location="ftp://127.0.0.1/x.png")
        else:
            self._send(404, b"unknown route", "text/plain")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that time out leave broken pipes behind, by design


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def hits(path: str) -> int:
    return _Handler.hits[path]


def test_http_ok_and_redirect(server: str) -> None:
    assert load_image(f"{server}/ok.png", ".", FAST).size == (9, 5)
    assert load_image(f"{server}/redirect", ".", FAST).size == (9, 5)
    assert load_image(f"{server}/ünï code.png", ".", FAST).size == (9, 5)  # encoded for us
    err = fails(f"{server}/redirect-ftp")
    assert outcome(err) == (415, "media.unsupported_scheme", "load")


@pytest.mark.parametrize("route, code, reason", [
    ("/missing", 404, "remote.not_found"),
    ("/gone", 404, "remote.not_found"),
    ("/forbidden", 403, "remote.forbidden"),
    ("/unauth", 403, "remote.forbidden"),
    ("/teapot", 400, "remote.client_error"),
])
def test_http_client_errors_are_not_retried(server: str, route: str, code: int, reason: str) -> None:
    path = f"{route}?t=client"
    err = fails(server + path, MediaConfig(fetch_timeout=0.5, fetch_retries=3))
    assert outcome(err) == (code, reason, "load") and err.error == "HTTPError"
    assert hits(path) == 1


def test_http_retry_recovers(server: str) -> None:
    assert load_image(f"{server}/flaky?t=1", ".", FAST, backoff=BACKOFF).size == (9, 5)
    assert hits("/flaky?t=1") == 2


def test_http_unavailable_after_exactly_all_retries(server: str) -> None:
    err = fails(f"{server}/down?t=1", MediaConfig(fetch_timeout=0.5, fetch_retries=2))
    assert outcome(err) == (503, "remote.unavailable", "load") and "3 attempts" in err.message
    assert hits("/down?t=1") == 3


def test_http_retry_after(server: str) -> None:
    assert load_image(f"{server}/ratelimited?wait=0", ".", FAST, backoff=BACKOFF).size == (9, 5)
    assert hits("/ratelimited?wait=0") == 2
    # A Retry-After longer than we are willing to wait: give up at once, not after sleeping.
    err = fails(f"{server}/ratelimited?wait=3600", MediaConfig(fetch_timeout=0.5, fetch_retries=3))
    assert outcome(err) == (503, "remote.unavailable", "load")
    assert hits("/ratelimited?wait=3600") == 1


def test_http_timeouts(server: str) -> None:
    cfg = MediaConfig(fetch_timeout=0.2, fetch_retries=1)
    err = fails(f"{server}/slow?t=1", cfg)
    assert outcome(err) == (504, "remote.timeout", "load") and hits("/slow?t=1") == 2
    # Bytes keep coming (no socket timeout ever fires), but the attempt's deadline does.
    err = fails(f"{server}/dribble?t=1", MediaConfig(fetch_timeout=0.3, fetch_retries=0))
    assert outcome(err) == (504, "remote.timeout", "load")


def test_http_size_limits(server: str) -> None:
    cfg = MediaConfig(max_file_bytes=1000, fetch_timeout=0.5, fetch_retries=2)
    assert outcome(fails(f"{server}/big?t=1", cfg)) == (413, "media.file_too_large", "load")
    assert outcome(fails(f"{server}/big-stream?t=1", cfg)) == (413, "media.file_too_large", "load")
    assert hits("/big?t=1") == 1 and hits("/big-stream?t=1") == 1


def test_http_short_body_is_retried(server: str) -> None:
    err = fails(f"{server}/short?t=1")
    assert outcome(err) == (400, "media.unreadable", "load") and hits("/short?t=1") == 2
    assert "got 50 of" in err.message  # a server that keeps sending less than it says: a truncated file


def test_http_html_page_is_unreadable(server: str) -> None:
    err = fails(f"{server}/html")
    assert outcome(err) == (400, "media.unreadable", "decode") and "text/html" in err.message


# --------------------------------------------------------------------------------------------
# describe_source


def test_describe_source() -> None:
    assert describe_source(None) is None
    assert describe_source("a/b.jpg") == "a/b.jpg"
    assert describe_source("https://x.org/a.jpg?sig=1") == "https://x.org/a.jpg?sig=1"
    assert describe_source("https://u:secret@x.org/a.jpg") == "https://u:***@x.org/a.jpg"
    assert describe_source(b"\0" * 1234) == "<1234 bytes inline>"
    uri = "data:image/png;base64,iVBORw0KGgo" + "A" * 1200
    assert describe_source(uri) == f"data:image/png;base64,iVBORw0KGgo…({len(uri)} chars)"
    assert describe_source("data:image/png;base64,AAAA") == "data:image/png;base64,AAAA"
    assert len(describe_source("x" * 5000)) < 300
