"""Getting an image's bytes (stage "load"): local paths, `file://` URLs, data URIs, inline bytes.

Also the helpers every source shares: the size checks, the `MMError` of a failed load, and how a
source is shown in the error report (`describe_source`: passwords masked, data URIs abbreviated).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import stat
import urllib.parse
from typing import Any, Callable, Iterator, TypeVar

from ..config import MediaConfig
from ..errors import MMError, classify, os_reason, trim_message

#: How sources may be written (paths need no scheme); named in the unsupported-scheme message.
SUPPORTED_SOURCES = "local paths, file://, http://, https:// and data: URIs"


SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


Source = str | bytes | bytearray | memoryview


T = TypeVar("T")


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
    if SCHEME.match(source):
        source = mask_password(source)
    return source if len(source) <= 1000 else f"{source[:200]}…({len(source)} chars)"


def guard(stage: str, fn: Callable[..., T], *args: Any) -> T:
    """Run one stage; any exception that is not already an MMError becomes one (last resort)."""
    try:
        return fn(*args)
    except MMError:
        raise
    except Exception as exc:
        raise classify(exc, stage) from exc


def load_error(message: str, reason: str, exc: BaseException | None = None) -> MMError:
    """An MMError at stage "load", keeping the original exception's type name."""
    return MMError(trim_message(message), stage="load", reason=reason,
                   error=exc_name(exc) if exc is not None else None)


def exc_name(exc: BaseException) -> str:
    """The exception's type name, module-qualified when the bare name says nothing (binascii.Error)."""
    cls = type(exc)
    return f"{cls.__module__}.{cls.__name__}" if cls.__name__ == "Error" else cls.__name__


def check_size(size: int, cfg: MediaConfig, what: str) -> None:
    """Refuse a payload over --max-file-bytes (or the clip's own limit) before (or while) reading it."""
    if size > cfg.max_file_bytes:
        raise load_error(f"{what} is larger than {cfg.limit_option} ({size} > {cfg.max_file_bytes})",
                         "media.file_too_large")


def check_payload(data: bytes, cfg: MediaConfig, what: str) -> bytes:
    """Refuse empty or oversized bytes; return them unchanged otherwise."""
    if not data:
        raise load_error(f"{what} is empty", "media.empty")
    check_size(len(data), cfg, what)
    return data


def read_file(path: str, cfg: MediaConfig) -> bytes:
    """Read a local file, checking type and size before reading a byte."""
    with _file_errors(path):
        check_file(path, cfg)
        with open(path, "rb") as fh:
            data = fh.read(cfg.max_file_bytes + 1)  # +1: a file that grew since stat still fails
    return check_payload(data, cfg, path)


def check_file(path: str, cfg: MediaConfig) -> None:
    """A local file that may be read: it exists, is a regular file, is not empty and not over the
    size limit (media that is opened where it lies, not read into memory, is checked by this alone)."""
    with _file_errors(path):
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise load_error(f"{path} is a directory, not a media file", "media.is_directory")
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block, /dev/zero never ends
            raise load_error(f"{path} is not a regular file", "media.invalid_source")
        if st.st_size == 0:
            raise load_error(f"{path} is empty", "media.empty")
        check_size(st.st_size, cfg, path)


def file_error(exc: OSError) -> MMError | None:
    """A local file's OSError as the load error it means (not found, permission denied, ...: the
    table `errors.OS_REASONS`); None for an error that says nothing of the file."""
    reason = os_reason(exc)
    return None if reason is None else load_error(f"cannot read media file: {exc}", reason, exc)


@contextlib.contextmanager
def _file_errors(path: str) -> Iterator[None]:
    """A local file's OSError or ValueError as the load error it means."""
    try:
        yield
    except OSError as exc:
        raise (file_error(exc) or classify(exc, "load")) from exc
    except ValueError as exc:  # e.g. "embedded null byte"
        raise load_error(f"invalid path {path!r}: {exc}", "media.invalid_source", exc) from exc


def file_url_path(url: str) -> str:
    """The local path a `file://` URL names (percent-decoded); only this host's files."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise load_error(f"file:// URL names another host ({parts.netloc}); use file:///path",
                         "media.invalid_source")
    path = urllib.parse.unquote(parts.path)
    if not path:
        raise load_error(f"file:// URL has no path: {url}", "media.invalid_source")
    return path


def data_uri_bytes(uri: str, cfg: MediaConfig) -> tuple[bytes, str | None]:
    """Decode `data:[<media type>][;base64],<data>`; only image/*, audio/*, video/* (or an untyped
    payload: the decoder tells by content)."""
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise load_error("malformed data URI: no ',' between header and data", "media.bad_data_uri")
    params = [p.strip() for p in header.split(";")]
    media_type = params[0].lower()
    is_base64 = any(p.lower() == "base64" for p in params[1:])
    if media_type and not re.fullmatch(r"[\w.+-]+/[\w.+-]+", media_type):
        raise load_error(f"malformed data URI: media type {params[0]!r} is not type/subtype",
                         "media.bad_data_uri")
    # An untyped or octet-stream payload is sniffed by Pillow: many producers write data:;base64,
    if media_type and not media_type.startswith(("image/", "audio/", "video/")) \
            and media_type != "application/octet-stream":
        raise load_error(f"data URI media type {media_type} is not an image, audio or video",
                         "media.unsupported_format")
    if not payload.strip():
        raise load_error("data URI has no data", "media.empty")
    check_size(len(payload) * 3 // 4 if is_base64 else len(payload), cfg, "data URI payload")
    data = _b64decode(payload) if is_base64 else urllib.parse.unquote_to_bytes(payload)
    return check_payload(data, cfg, "data URI payload"), media_type or None


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
        raise load_error(f"invalid base64 in data URI: {exc}", "media.bad_base64", exc) from exc


def mask_password(url: str) -> str:
    """A URL with the password of its user info replaced by ***, so reports leak no secrets."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:  # unparsable (e.g. a broken IPv6 host): the fetch reports it
        return url
    netloc = f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
