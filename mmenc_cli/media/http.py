"""Fetching `http(s)://` images with bounded time and retries of transient failures.

Each attempt ends after about `--fetch-timeout`, the whole exchange included: a watchdog shuts
the attempt's sockets down at its deadline, so a server that trickles its status line, headers or
body a byte at a time cannot hold it longer (the socket timeout alone resets at every byte); an
attempt it ended is a timeout (504 `remote.timeout`), whatever the cut exchange looked like. 408,
429, 5xx, refused connections, DNS failures and resets are retried `--fetch-retries` times with
exponential back-off and jitter, honouring a server's Retry-After up to `RETRY_AFTER_MAX_S`. An
answer shorter than its Content-Length is retried too, then is 400 (`media.unreadable`: "got N
of M bytes"). Redirects are followed only to http(s). The final status maps to one `MMError`
(`_http_error`).
"""

from __future__ import annotations

import email.utils
import http.client
import random
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..config import MediaConfig
from ..errors import MMError, classify, os_reason, trim_message
from .sources import SUPPORTED_SOURCES, check_payload, check_size, describe_source, load_error

#: Back-off before retry n (0-based) is min(CAP, BASE * 2**n) times a jitter in [0.5, 1].
BACKOFF_BASE_S = 0.5


BACKOFF_CAP_S = 8.0


#: A server's Retry-After is honoured up to this; a longer one means give up now, not wait.
RETRY_AFTER_MAX_S = 30.0


USER_AGENT = "mmenc/0.1 (offline embedding precomputation)"


_CHUNK = 1 << 16


class Transient(Exception):
    """A fetch failure worth retrying; `error` is what to report if no retry succeeds."""

    def __init__(self, error: MMError, retry_after: float | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.retry_after = retry_after


class _RedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s): urllib would also follow one to ftp://, and refuse one to
    file:// as an HTTP error; both are a scheme mmenc does not fetch (415)."""

    def http_error_302(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any) -> Any:
        target = headers.get("location") or headers.get("uri")
        if target:
            self._check_scheme(urllib.parse.urljoin(req.full_url, target), fp)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    @staticmethod
    def _check_scheme(newurl: str, fp: Any) -> None:
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in ("http", "https"):
            fp.close()
            raise load_error(f"redirected to unsupported URL scheme {scheme}://; supported: "
                             f"{SUPPORTED_SOURCES}", "media.unsupported_scheme")

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in ("http", "https"):
            fp.close()
            raise load_error(f"redirected to unsupported URL scheme {scheme}://; supported: "
                             f"{SUPPORTED_SOURCES}", "media.unsupported_scheme")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _Watchdog:
    """Ends one attempt at its deadline by shutting down the sockets it opened."""

    def __init__(self, seconds: float) -> None:
        self.fired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.fired:
                _shutdown(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                _shutdown(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


def _watched(connection: type, dog: _Watchdog) -> type:
    """`connection` (HTTPConnection or HTTPSConnection) with its TCP socket watched by `dog`,
    registered before a TLS handshake can trickle."""

    class Watched(connection):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            create = self._create_connection

            def create_and_watch(*a: Any, **k: Any) -> socket.socket:
                sock = create(*a, **k)
                dog.watch(sock)
                return sock

            self._create_connection = create_and_watch

    return Watched


class _Watched:
    """A urllib handler whose connections `dog` watches (mixed into the HTTP and HTTPS handlers)."""

    def __init__(self, dog: _Watchdog) -> None:
        super().__init__()
        self.dog = dog

    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_watched(http_class, self.dog), req, **kwargs)  # type: ignore[misc]


class _WatchedHTTP(_Watched, urllib.request.HTTPHandler):
    pass


class _WatchedHTTPS(_Watched, urllib.request.HTTPSHandler):
    pass


class NoRanges(Exception):
    """The server answered a range request with another range than asked: not to be trusted."""


def fetch(url: str, cfg: MediaConfig, backoff: float) -> tuple[bytes, str | None]:
    """GET `url` with up to `cfg.fetch_retries` retries of transient failures.

    Time is bounded: each attempt ends after about `fetch_timeout` (the whole exchange), and each
    wait is at most max(BACKOFF_CAP_S, RETRY_AFTER_MAX_S)."""
    data, content_type, _, _ = _with_retries(url, cfg, backoff, None)
    return data, content_type


def fetch_range(url: str, cfg: MediaConfig, backoff: float, start: int,
                length: int) -> tuple[bytes, int | None, bool]:
    """GET bytes from `start` (at most `length`) of `url`, retried like `fetch`: (the bytes, the
    resource's whole size from Content-Range (None: not said), True) for a range; (the whole body,
    its size, False) when the server ignores ranges. `NoRanges` when it answers another range."""
    data, _, total, partial = _with_retries(url, cfg, backoff, (start, start + length - 1))
    return data, (total if partial else len(data)), partial


def _with_retries(url: str, cfg: MediaConfig, backoff: float,
                  byte_range: tuple[int, int] | None) -> tuple[bytes, str | None, int | None, bool]:
    attempts = 1 + cfg.fetch_retries
    last: Transient | None = None
    for attempt in range(attempts):
        try:
            return _fetch_once(url, cfg, byte_range)
        except Transient as exc:
            last = exc
            delay = None if attempt + 1 == attempts else _retry_delay(attempt, backoff, exc.retry_after)
            if delay is None:
                break
            time.sleep(delay)
    assert last is not None  # the loop either returned or caught a Transient
    err = last.error
    tries = f"{attempt + 1} attempt" + ("s" if attempt else "")
    raise MMError(trim_message(f"{err.message} (gave up after {tries})"), stage="load",
                  reason=err.reason, error=err.error)


def _retry_delay(attempt: int, base: float, retry_after: float | None) -> float | None:
    """Seconds before the next attempt: exponential back-off with jitter, at least the server's
    Retry-After; None when that Retry-After is too long to wait for."""
    delay = min(BACKOFF_CAP_S, base * 2**attempt) * random.uniform(0.5, 1.0)
    if retry_after is None:
        return delay
    return None if retry_after > RETRY_AFTER_MAX_S else max(delay, retry_after)


def _fetch_once(url: str, cfg: MediaConfig,
                byte_range: tuple[int, int] | None) -> tuple[bytes, str | None, int | None, bool]:
    """One GET within `fetch_timeout`; raises `Transient` for what a retry may fix, `MMError` for
    the rest."""
    dog = _Watchdog(cfg.fetch_timeout)
    try:
        answer = _exchange(url, cfg, dog, byte_range)
    except (urllib.error.URLError, OSError, http.client.HTTPException, Transient, MMError) as exc:
        if not dog.fired:
            raise
        raise _timed_out(url, cfg, exc) from exc
    finally:
        dog.cancel()
    if dog.fired:  # headers cut at the deadline end as if complete: the answer is not the server's
        raise _timed_out(url, cfg, None)
    return answer


def _timed_out(url: str, cfg: MediaConfig, exc: BaseException | None) -> Transient:
    """An attempt the watchdog ended, whatever the exchange looked like after its sockets closed
    (headers cut short parse as complete ones, a body cut short as an empty one)."""
    return Transient(load_error(f"no complete answer from {describe_source(url)} within "
                                f"{cfg.fetch_timeout:g}s", "remote.timeout", exc))


def _exchange(url: str, cfg: MediaConfig, dog: _Watchdog,
              byte_range: tuple[int, int] | None = None) -> tuple[bytes, str | None, int | None, bool]:
    shown = describe_source(url)
    deadline = time.monotonic() + cfg.fetch_timeout
    total, partial = None, False
    try:
        headers = {"User-Agent": USER_AGENT, "Accept": "image/*" if byte_range is None else "*/*"}
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        request = urllib.request.Request(_to_uri(url), headers=headers)
        opener = urllib.request.build_opener(_RedirectHandler, _WatchedHTTP(dog), _WatchedHTTPS(dog))
        with opener.open(request, timeout=cfg.fetch_timeout) as resp:
            if time.monotonic() > deadline:  # the status line and headers took the whole attempt
                raise TimeoutError(f"headers not received within {cfg.fetch_timeout:g}s")
            if byte_range is not None and resp.status == 206:  # else (200) the whole body follows
                first, total = _content_range(resp.headers.get("Content-Range", ""))
                if first != byte_range[0]:
                    raise NoRanges(f"{shown} answered the range from byte {byte_range[0]} with one from {first}")
                if total is not None:
                    check_size(total, cfg, shown)
                partial = True
            declared = resp.headers.get("Content-Length", "").strip()
            expected = int(declared) if declared.isdigit() else None
            if expected is not None:
                check_size(expected, cfg, shown)
            data = _read_body(resp, cfg, deadline, shown)
            content_type = resp.headers.get_content_type() if resp.headers.get("Content-Type") else None
    except urllib.error.HTTPError as exc:
        exc.close()
        error = _http_error(exc.code, str(exc.reason or ""), shown)
        if exc.code in (408, 429) or exc.code >= 500:
            raise Transient(error, _parse_retry_after(exc.headers.get("Retry-After"))) from exc
        raise error from exc
    except urllib.error.URLError as exc:
        if dog.fired:
            raise
        raise _network_error(exc.reason, shown, cfg) from exc
    except (OSError, http.client.HTTPException) as exc:  # raised while reading the body
        if dog.fired:
            raise
        raise _network_error(exc, shown, cfg) from exc
    except ValueError as exc:  # a URL that cannot be parsed or encoded
        raise load_error(f"invalid URL {shown}: {exc}", "media.invalid_source", exc) from exc
    if expected is not None and len(data) < expected:  # retried; one that keeps doing it serves a truncated file
        raise Transient(load_error(f"{shown} ended its answer early: got {len(data)} of {expected} bytes "
                                   "(its Content-Length)", "media.unreadable"))
    return check_payload(data, cfg, shown), content_type, total, partial


def _content_range(header: str) -> tuple[int | None, int | None]:
    """(first byte, whole size) of a Content-Range header ("bytes 0-99/1234"); None where it does
    not say (a size of "*", a malformed header)."""
    span, _, total = header.removeprefix("bytes").strip().partition("/")
    first = span.partition("-")[0].strip()
    return (int(first) if first.isdigit() else None), (int(total) if total.strip().isdigit() else None)


def _to_uri(url: str) -> str:
    """Percent-encode what manifests often hold raw in URLs (spaces, non-ASCII path, IDN host);
    existing %-escapes are kept."""
    if url.isascii() and " " not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    safe = "/%:@!$&'()*+,;=-._~"
    netloc = parts.netloc if parts.netloc.isascii() else parts.netloc.encode("idna").decode("ascii")
    return urllib.parse.urlunsplit((parts.scheme, netloc, urllib.parse.quote(parts.path, safe),
                                    urllib.parse.quote(parts.query, safe + "?"),
                                    urllib.parse.quote(parts.fragment, safe + "?")))


def _read_body(resp: http.client.HTTPResponse, cfg: MediaConfig, deadline: float, shown: str) -> bytes:
    """Stream the body, failing as soon as it passes --max-file-bytes or the attempt's deadline
    (a server dribbling bytes never trips the per-read socket timeout)."""
    chunks: list[bytes] = []
    total = 0
    while chunk := resp.read1(_CHUNK):  # read1: returns what arrived, so the deadline is checked
        total += len(chunk)
        check_size(total, cfg, shown)
        if time.monotonic() > deadline:
            raise TimeoutError(f"body not received within {cfg.fetch_timeout:g}s")
        chunks.append(chunk)
    return b"".join(chunks)


def _http_error(status: int, phrase: str, shown: str) -> MMError:
    """The one mapping from a final HTTP status to an MMError."""
    if status in (404, 410):
        reason = "remote.not_found"
    elif status in (401, 403, 407):
        reason = "remote.forbidden"
    elif status == 408:
        reason = "remote.timeout"
    elif status == 429 or status >= 500:
        reason = "remote.unavailable"
    else:  # other 4xx, and a 3xx urllib did not follow (redirect loop, 300, 304)
        reason = "remote.client_error"
    status_line = f"HTTP {status} {phrase}" if phrase else f"HTTP {status}"
    return MMError(f"{status_line} from {shown}", stage="load", reason=reason, error="HTTPError")


def _network_error(exc: BaseException | str, shown: str, cfg: MediaConfig) -> Transient | MMError:
    """Map a connection-level failure: timeouts, refusals, DNS, resets are transient."""
    if isinstance(exc, str):  # urllib's own complaints: "no host given", "unknown url type"
        return load_error(f"invalid URL {shown}: {exc}", "media.invalid_source")
    if isinstance(exc, MMError):
        return exc
    if isinstance(exc, http.client.InvalidURL):
        return load_error(f"invalid URL {shown}: {exc}", "media.invalid_source", exc)
    what = f"{type(exc).__name__}: {exc}"
    reason = os_reason(exc, connection=True)
    if reason == "remote.timeout":
        return Transient(load_error(f"timed out after {cfg.fetch_timeout:g}s fetching {shown}: "
                                    f"{exc}", "remote.timeout", exc))
    if isinstance(exc, ssl.SSLCertVerificationError):  # retrying cannot fix a bad certificate
        return load_error(f"TLS certificate of {shown} rejected: {exc}", "remote.unavailable", exc)
    if reason is not None:
        return load_error(f"cannot fetch {shown}: {what}", reason, exc)
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return Transient(load_error(f"cannot fetch {shown}: {what}", "remote.unavailable", exc))
    return classify(exc, "load")


def _parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (delta-seconds or an HTTP date); None if absent or unreadable."""
    value = (value or "").strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())
