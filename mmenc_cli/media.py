"""Loading one image from a manifest's `image` value, inside a decode worker process.

Sources: a local path (relative paths resolve against the manifest's folder, `~` is expanded),
`file://` and `http(s)://` URLs (stdlib urllib, retried with back-off), `data:` URIs and raw bytes
(Parquet inline). `load_image` either returns a fully decoded RGB image or raises `MMError` with
stage "load" (getting the bytes) or "decode" (bytes to pixels) and a reason from
`errors.REASONS`; no other exception escapes it.

What comes back is always RGB, whatever the file held:

- EXIF orientation applied (orientation 6 or 8 swaps width and height);
- alpha (RGBA, LA, PA, a palette or grey image with a transparent colour) composited on white,
  because the colour under fully transparent pixels is arbitrary (often black) and white is what
  a viewer shows;
- 16-bit grey (mode I;16) scaled to 8 bits by /257 (not clipped: clipping turns most of a 16-bit
  image white); 32-bit integer grey (mode I) kept if its values fit 8 bits, else /257 if they fit
  16 bits; float grey from [0, 1] by x255; anything else (negative, wider, HDR) min-max scaled;
- CMYK through Pillow's conversion (no ICC colour management); multi-frame GIF, TIFF, WebP: the
  first frame.

No torch or transformers here: this module runs in every decode worker.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import errno
import functools
import http.client
import io
import os
import random
import re
import ssl
import stat
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zlib
from typing import Any, Callable, TypeVar

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from .config import MediaConfig
from .errors import MMError, classify, trim_message

#: How sources may be written (paths need no scheme); named in the unsupported-scheme message.
SUPPORTED_SOURCES = "local paths, file://, http://, https:// and data: URIs"
#: Back-off before retry n (0-based) is min(CAP, BASE * 2**n) times a jitter in [0.5, 1].
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 8.0
#: A server's Retry-After is honoured up to this; a longer one means give up now, not wait.
RETRY_AFTER_MAX_S = 30.0
USER_AGENT = "mmenc/0.1 (offline embedding precomputation)"
#: Formats Pillow could open that we refuse: EPS runs Ghostscript on untrusted input.
EXCLUDED_FORMATS = frozenset({"EPS"})
#: Codecs every sane Pillow build has: lacking one is our install's fault (500), not the input's.
EXPECTED_CODECS = frozenset({"WEBP", "JPEG", "ZLIB", "PNG"})

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_CHUNK = 1 << 16
_WHITE = (255, 255, 255, 255)
_HEIF_BRANDS = {"heic": "HEIC", "heix": "HEIC", "hevc": "HEIC", "hevx": "HEIC", "heim": "HEIC",
                "heis": "HEIC", "mif1": "HEIF", "msf1": "HEIF", "avif": "AVIF", "avis": "AVIF"}
# Pillow's own wording for these cases; matched so the code/reason do not depend on exception types.
_DECODER_MISSING = re.compile(r"(?:decoder|encoder) \S+ not available")
_NOT_INSTALLED = re.compile(r"because (\w+) support not installed")
_TOO_BIG_CHUNK = re.compile(r"decompressed data too large", re.IGNORECASE)
# Exceptions Pillow raises on corrupt or truncated input (it uses all of these in its plugins).
_CORRUPT = (OSError, SyntaxError, EOFError, ValueError, struct.error, zlib.error, IndexError)

Source = str | bytes | bytearray | memoryview
T = TypeVar("T")


class _Transient(Exception):
    """A fetch failure worth retrying; `error` is what to report if no retry succeeds."""

    def __init__(self, error: MMError, retry_after: float | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.retry_after = retry_after


# --------------------------------------------------------------------------------------------
# Public API


def load_image(source: Source, base_dir: str, cfg: MediaConfig, *,
               backoff: float | None = None) -> Image.Image:
    """Load, decode and normalise one image to a fully loaded RGB `PIL.Image`.

    `base_dir` resolves relative paths (the manifest's folder). `backoff` overrides
    `BACKOFF_BASE_S` (tests use a tiny one). Every failure is an `MMError` (see module docstring).
    """
    data, content_type = _guard("load", _load_bytes, source, base_dir, cfg,
                                BACKOFF_BASE_S if backoff is None else backoff)
    return _guard("decode", _decode, data, cfg, content_type)


def describe_source(source: Source | None) -> str | None:
    """What the error report shows as `source`: the path or URL as given (a URL's password
    masked), a data URI abbreviated to its header and first bytes, inline bytes as their size."""
    if source is None:
        return None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(source)} bytes inline>"
    if not isinstance(source, str):
        return f"<{type(source).__name__}>"
    if source[:5].lower() == "data:":
        if len(source) <= 80:
            return source
        header, _, payload = source.partition(",")
        return f"{header[:60]},{payload[:11]}…({len(source)} chars)"
    if _SCHEME.match(source):
        source = _mask_password(source)
    return source if len(source) <= 1000 else f"{source[:200]}…({len(source)} chars)"


def configure_pillow(cfg: MediaConfig) -> None:
    """Make `cfg.max_image_pixels` the one pixel limit in this process: call it once in each
    decode worker's initializer, never in a process that others share, since it changes Pillow's
    process-wide state. Without it Pillow's own bomb check still caps a raised
    --max-image-pixels at twice Pillow's limit and prints warnings that `load_image` already turns
    into `media.too_large` errors."""
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and limit < cfg.max_image_pixels:
        Image.MAX_IMAGE_PIXELS = cfg.max_image_pixels
    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


# --------------------------------------------------------------------------------------------
# Getting the bytes (stage "load")


def _guard(stage: str, fn: Callable[..., T], *args: Any) -> T:
    """Run one stage; any exception that is not already an MMError becomes one (last resort)."""
    try:
        return fn(*args)
    except MMError:
        raise
    except Exception as exc:
        raise classify(exc, stage) from exc


def _load_error(message: str, reason: str, exc: BaseException | None = None) -> MMError:
    """An MMError at stage "load", keeping the original exception's type name."""
    return MMError(trim_message(message), stage="load", reason=reason,
                   error=_exc_name(exc) if exc is not None else None)


def _exc_name(exc: BaseException) -> str:
    """The exception's type name, module-qualified when the bare name says nothing (binascii.Error)."""
    cls = type(exc)
    return f"{cls.__module__}.{cls.__name__}" if cls.__name__ == "Error" else cls.__name__


def _load_bytes(source: Source, base_dir: str, cfg: MediaConfig,
                backoff: float) -> tuple[bytes, str | None]:
    """The raw bytes of `source` and, where known, their declared media type."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _check_payload(bytes(source), cfg, "inline image bytes"), None
    if not isinstance(source, str) or not source.strip():
        got = "an empty string" if isinstance(source, str) else type(source).__name__
        raise _load_error(f"the image field must be a path, URL, data URI or bytes, got {got}",
                          "media.invalid_source")
    if source[:5].lower() == "data:":
        return _data_uri_bytes(source, cfg)
    match = _SCHEME.match(source)
    if match is None:
        path = os.path.join(base_dir, os.path.expanduser(source))
        return _read_file(path, cfg), None
    scheme = match.group(1).lower()
    if scheme == "file":
        return _read_file(_file_url_path(source), cfg), None
    if scheme in ("http", "https"):
        return _fetch(source, cfg, backoff)
    raise _load_error(f"unsupported URL scheme {scheme}://; supported: {SUPPORTED_SOURCES}",
                      "media.unsupported_scheme")


def _check_size(size: int, cfg: MediaConfig, what: str) -> None:
    """Refuse a payload over --max-file-bytes before (or while) reading it."""
    if size > cfg.max_file_bytes:
        raise _load_error(f"{what} is larger than --max-file-bytes ({size} > {cfg.max_file_bytes})",
                          "media.file_too_large")


def _check_payload(data: bytes, cfg: MediaConfig, what: str) -> bytes:
    """Refuse empty or oversized bytes; return them unchanged otherwise."""
    if not data:
        raise _load_error(f"{what} is empty", "media.empty")
    _check_size(len(data), cfg, what)
    return data


_ERRNO_REASONS = {
    errno.ENOENT: "media.not_found",
    errno.ENOTDIR: "media.not_found",  # a component of the path is a file
    errno.EACCES: "media.permission_denied",
    errno.EPERM: "media.permission_denied",
    errno.EISDIR: "media.is_directory",
    errno.ENAMETOOLONG: "media.invalid_source",
    errno.ELOOP: "media.invalid_source",
}


def _read_file(path: str, cfg: MediaConfig) -> bytes:
    """Read a local file, checking type and size before reading a byte."""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise _load_error(f"{path} is a directory, not an image file", "media.is_directory")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block, /dev/zero never ends
            raise _load_error(f"{path} is not a regular file", "media.invalid_source")
        _check_size(st.st_size, cfg, path)
        with open(path, "rb") as fh:
            data = fh.read(cfg.max_file_bytes + 1)  # +1: a file that grew since stat still fails
    except OSError as exc:
        reason = _ERRNO_REASONS.get(exc.errno or 0)
        if reason is None:
            raise classify(exc, "load") from exc
        raise _load_error(f"cannot read image file: {exc}", reason, exc) from exc
    except ValueError as exc:  # e.g. "embedded null byte"
        raise _load_error(f"invalid path {path!r}: {exc}", "media.invalid_source", exc) from exc
    return _check_payload(data, cfg, path)


def _file_url_path(url: str) -> str:
    """The local path a `file://` URL names (percent-decoded); only this host's files."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _load_error(f"file:// URL names another host ({parts.netloc}); use file:///path",
                          "media.invalid_source")
    path = urllib.parse.unquote(parts.path)
    if not path:
        raise _load_error(f"file:// URL has no path: {url}", "media.invalid_source")
    return path


def _data_uri_bytes(uri: str, cfg: MediaConfig) -> tuple[bytes, str | None]:
    """Decode `data:[<media type>][;base64],<data>`; only image/* (or an untyped payload)."""
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise _load_error("malformed data URI: no ',' between header and data", "media.bad_data_uri")
    params = [p.strip() for p in header.split(";")]
    media_type = params[0].lower()
    is_base64 = any(p.lower() == "base64" for p in params[1:])
    if media_type and not re.fullmatch(r"[\w.+-]+/[\w.+-]+", media_type):
        raise _load_error(f"malformed data URI: media type {params[0]!r} is not type/subtype",
                          "media.bad_data_uri")
    # An untyped or octet-stream payload is sniffed by Pillow: many producers write data:;base64,
    if media_type and not media_type.startswith("image/") and media_type != "application/octet-stream":
        raise _load_error(f"data URI media type {media_type} is not an image",
                          "media.unsupported_format")
    if not payload.strip():
        raise _load_error("data URI has no data", "media.empty")
    _check_size(len(payload) * 3 // 4 if is_base64 else len(payload), cfg, "data URI payload")
    data = _b64decode(payload) if is_base64 else urllib.parse.unquote_to_bytes(payload)
    return _check_payload(data, cfg, "data URI payload"), media_type or None


def _b64decode(text: str) -> bytes:
    """Strict base64, tolerant only of what producers commonly emit: whitespace, URL-safe
    alphabet, percent-encoding, missing padding."""
    text = "".join(text.split())
    if "%" in text:
        text = urllib.parse.unquote(text)
    text = text.replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _load_error(f"invalid base64 in data URI: {exc}", "media.bad_base64", exc) from exc


def _mask_password(url: str) -> str:
    """A URL with the password of its user info replaced by ***, so reports leak no secrets."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:  # unparsable (e.g. a broken IPv6 host): the fetch reports it
        return url
    netloc = f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


# --------------------------------------------------------------------------------------------
# HTTP(S) with retries


class _RedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follow redirects only to http(s): urllib would also follow one to ftp://."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Any, newurl: str) -> urllib.request.Request | None:
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in ("http", "https"):
            fp.close()
            raise _load_error(f"redirected to unsupported URL scheme {scheme}://; supported: "
                              f"{SUPPORTED_SOURCES}", "media.unsupported_scheme")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, cfg: MediaConfig, backoff: float) -> tuple[bytes, str | None]:
    """GET `url` with up to `cfg.fetch_retries` retries of transient failures.

    Time is bounded: each attempt ends after about `fetch_timeout` (connect, each read and the
    whole body), and each wait is at most max(BACKOFF_CAP_S, RETRY_AFTER_MAX_S)."""
    attempts = 1 + cfg.fetch_retries
    last: _Transient | None = None
    for attempt in range(attempts):
        try:
            return _fetch_once(url, cfg)
        except _Transient as exc:
            last = exc
            delay = None if attempt + 1 == attempts else _retry_delay(attempt, backoff, exc.retry_after)
            if delay is None:
                break
            time.sleep(delay)
    assert last is not None  # the loop either returned or caught a _Transient
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


def _fetch_once(url: str, cfg: MediaConfig) -> tuple[bytes, str | None]:
    """One GET; raises `_Transient` for what a retry may fix, `MMError` for the rest."""
    shown = describe_source(url)
    deadline = time.monotonic() + cfg.fetch_timeout
    try:
        request = urllib.request.Request(_to_uri(url), headers={"User-Agent": USER_AGENT,
                                                                "Accept": "image/*"})
        with urllib.request.build_opener(_RedirectHandler).open(request, timeout=cfg.fetch_timeout) as resp:
            declared = resp.headers.get("Content-Length", "").strip()
            expected = int(declared) if declared.isdigit() else None
            if expected is not None:
                _check_size(expected, cfg, shown)
            data = _read_body(resp, cfg, deadline, shown)
            content_type = resp.headers.get_content_type() if resp.headers.get("Content-Type") else None
    except urllib.error.HTTPError as exc:
        exc.close()
        error = _http_error(exc.code, str(exc.reason or ""), shown)
        if exc.code in (408, 429) or exc.code >= 500:
            raise _Transient(error, _parse_retry_after(exc.headers.get("Retry-After"))) from exc
        raise error from exc
    except urllib.error.URLError as exc:
        raise _network_error(exc.reason, shown, cfg) from exc
    except (OSError, http.client.HTTPException) as exc:  # raised while reading the body
        raise _network_error(exc, shown, cfg) from exc
    except ValueError as exc:  # a URL that cannot be parsed or encoded
        raise _load_error(f"invalid URL {shown}: {exc}", "media.invalid_source", exc) from exc
    if expected is not None and len(data) < expected:
        raise _Transient(_load_error(f"connection closed after {len(data)} of {expected} bytes "
                                     f"from {shown}", "remote.unavailable"))
    return _check_payload(data, cfg, shown), content_type


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
        _check_size(total, cfg, shown)
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


def _network_error(exc: BaseException | str, shown: str, cfg: MediaConfig) -> _Transient | MMError:
    """Map a connection-level failure: timeouts, refusals, DNS, resets are transient."""
    if isinstance(exc, str):  # urllib's own complaints: "no host given", "unknown url type"
        return _load_error(f"invalid URL {shown}: {exc}", "media.invalid_source")
    if isinstance(exc, MMError):
        return exc
    if isinstance(exc, http.client.InvalidURL):
        return _load_error(f"invalid URL {shown}: {exc}", "media.invalid_source", exc)
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError):
        return _Transient(_load_error(f"timed out after {cfg.fetch_timeout:g}s fetching {shown}: "
                                      f"{exc}", "remote.timeout", exc))
    if isinstance(exc, ssl.SSLCertVerificationError):  # retrying cannot fix a bad certificate
        return _load_error(f"TLS certificate of {shown} rejected: {exc}", "remote.unavailable", exc)
    if isinstance(exc, (OSError, http.client.HTTPException)):
        return _Transient(_load_error(f"cannot fetch {shown}: {what}", "remote.unavailable", exc))
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


# --------------------------------------------------------------------------------------------
# Bytes to pixels (stage "decode")


@functools.cache
def _formats() -> tuple[str, ...]:
    """Every format Pillow can open here (with pillow-heif's when installed), minus the excluded."""
    try:  # optional: HEIC/HEIF decode when the plugin is installed, 415 otherwise
        import pillow_heif  # type: ignore[import-not-found]

        pillow_heif.register_heif_opener()
    except Exception:
        pass
    Image.init()
    return tuple(f for f in Image.ID if f not in EXCLUDED_FORMATS)


def _decode(data: bytes, cfg: MediaConfig, content_type: str | None) -> Image.Image:
    """Identify, size-check, fully decode and normalise to RGB. Never mutates Pillow globals."""
    try:
        im = Image.open(io.BytesIO(data), formats=_formats())
        width, height = im.size
        if width * height > cfg.max_image_pixels:  # from the header, before any pixel is decoded
            raise MMError(f"image is {width}x{height} = {width * height} pixels, over the "
                          f"--max-image-pixels limit of {cfg.max_image_pixels}", stage="decode",
                          reason="media.too_large")
        if width <= 0 or height <= 0:
            raise MMError(f"image has no pixels ({width}x{height})", stage="decode",
                          reason="media.unreadable")
        im.load()  # decodes now, so truncation fails here and not in the encoder
        _apply_orientation(im)
        rgb = _to_rgb(im)
    except MMError:
        raise
    except Exception as exc:
        raise _decode_error(exc, data, content_type) from exc
    # Detach from the reader (a multi-frame file keeps its buffer for seeking).
    return rgb.copy() if isinstance(rgb, ImageFile.ImageFile) else rgb


def _decode_error(exc: BaseException, data: bytes, content_type: str | None) -> MMError:
    """The one mapping from a Pillow (or numpy) failure on some bytes to an MMError."""
    name = type(exc).__name__
    text = str(exc) or name

    def error(message: str, reason: str) -> MMError:
        return MMError(trim_message(message), stage="decode", reason=reason, error=name)

    if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)) \
            or _TOO_BIG_CHUNK.search(text):
        return error(text, "media.too_large")
    if isinstance(exc, UnidentifiedImageError):
        missing = _NOT_INSTALLED.search(_plugin_complaint(data))
        if missing and missing.group(1).upper() in EXPECTED_CODECS:
            return error(f"Pillow here lacks {missing.group(1)} support: {text}", "media.decoder_missing")
        fmt = missing.group(1) if missing else _sniff_unsupported(data)
        if fmt:
            return error(f"{fmt} images are not supported by this install (Pillow "
                         f"{Image.__version__}); convert them to JPEG, PNG or WebP",
                         "media.unsupported_format")
        declared = f", declared {content_type}" if content_type else ""
        return error(f"not an image Pillow can identify ({len(data)} bytes starting "
                     f"{data[:16]!r}{declared})", "media.unreadable")
    if isinstance(exc, OSError) and _DECODER_MISSING.search(text):
        return error(f"Pillow here lacks a decoder: {text}", "media.decoder_missing")
    if isinstance(exc, _CORRUPT):
        return error(f"corrupt or truncated image: {text}", "media.unreadable")
    return classify(exc, "decode")


def _plugin_complaint(data: bytes) -> str:
    """What a Pillow plugin says about bytes it recognises but cannot open here ("... because
    WEBP support not installed"). Pillow only warns it, so ask the plugins' `_accept` again."""
    prefix = data[:16]  # what Image.open hands to `_accept`
    for _, accept in Image.OPEN.values():
        try:
            result = accept(prefix) if accept else None
        except Exception:
            continue
        if isinstance(result, str):
            return result
    return ""


def _sniff_unsupported(data: bytes) -> str | None:
    """Name a well-known format Pillow cannot open here, from its magic bytes, so the error says
    415 (HEIC, AVIF without its plugin, JPEG XL, SVG, PDF, PostScript) rather than 'corrupt'."""
    head = data[:512]
    if head[4:8] == b"ftyp":
        brand = head[8:12].decode("latin-1").strip().lower()
        return _HEIF_BRANDS.get(brand, f"ISO media (brand {brand!r})")
    if head.startswith((b"\xff\x0a", b"\x00\x00\x00\x0cJXL ")):
        return "JPEG XL"
    if head.startswith(b"%PDF-"):
        return "PDF"
    if head.startswith((b"%!PS", b"\xc5\xd0\xd3\xc6")):
        return "PostScript/EPS"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if text.startswith((b"<svg", b"<?xml", b"<!doctype svg")) and b"<svg" in head.lower():
        return "SVG"
    return None


def _apply_orientation(im: Image.Image) -> None:
    """Apply EXIF orientation in place. A corrupt EXIF block is ignored, not fatal: the pixels
    are fine, and phone photos with broken maker notes are common."""
    try:
        ImageOps.exif_transpose(im, in_place=True)
    except Exception:
        pass


def _to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode to RGB: alpha composited on white, high bit depths scaled, not clipped."""
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        return Image.fromarray(_grey_to_uint8(np.asarray(im), im.mode), "L").convert("RGB")
    try:
        if im.has_transparency_data:
            rgba = im.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", im.size, _WHITE), rgba).convert("RGB")
        return im if im.mode == "RGB" else im.convert("RGB")
    except ValueError as exc:  # a mode Pillow has no conversion for
        raise MMError(f"image mode {im.mode} cannot be converted to RGB: {exc}", stage="decode",
                      reason="media.unsupported_format", error=type(exc).__name__) from exc


def _grey_to_uint8(a: np.ndarray, mode: str) -> np.ndarray:
    """Scale one high-bit-depth grey channel to 0..255. I;16 by /257; F from [0, 1] by x255;
    I (32-bit int, ambiguous) by 255 or 65535, whichever range its values fit; anything else
    (negative, wider, HDR floats) by its own min..max. Non-finite values count as 0."""
    a = np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if mode.startswith("I;16"):
        full: float | None = 65535.0
    elif mode == "F":
        full = 1.0 if lo >= 0 and hi <= 1 else None
    elif lo >= 0 and hi <= 255:
        full = 255.0
    elif lo >= 0 and hi <= 65535:
        full = 65535.0
    else:
        full = None
    if full is None:
        a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
    else:
        a = a * (255.0 / full)
    return np.clip(np.round(a), 0, 255).astype(np.uint8)
