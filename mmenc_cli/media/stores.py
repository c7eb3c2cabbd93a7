"""Media in object stores, through fsspec (`STORES`: `s3://`, `gs://`, `az://`, `hf://`, ...)
where the matching backend is installed; any other scheme (ftp://, ...) is one we do not fetch
(415, naming the package to install where one would do).

An image in S3 costs one request: a GetObject whose Content-Length is checked against the size
limit before the body is read; botocore retries a 503 SlowDown with back-off. Many such GETs run at
once in a decode worker (`ahead.py`): on threads sharing one plain botocore client built from the
filesystem's settings (`blocking_client`, `fetch_object`: a blocking client costs less CPU per GET
than aiobotocore's), or as coroutines on s3fs's event loop (`get_object`) where those settings
hold options we do not map. Other stores are checked
(`fs.info`) and then read. Audio and video are opened where they lie (`StoreFile`): PyAV reads
only the byte ranges it decodes.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from ..config import MediaConfig
from ..errors import MMError, client_reason, os_reason
from .sources import SUPPORTED_SOURCES, check_payload, check_size, describe_source, load_error

#: the URL schemes read through fsspec (object stores, the Hugging Face hub, fsspec's memory store)
STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "hf", "memory", "file", "local"})

#: connections one S3 client keeps open: as many as a worker's GETs in flight (`ahead.FETCH_AHEAD`)
POOL_CONNECTIONS = 32

#: awaited with an object's size once its answer is in, before its body is read (`ahead.py`'s bytes budget)
Reserve = Callable[[int], Awaitable[None]]

#: s3fs options a plain botocore client is built from (`blocking_client`); with any other set, an
#: image is read through s3fs (anonymous access, requester pays, a profile, extra call arguments...)
MAPPED = frozenset({"key", "secret", "token", "endpoint_url", "client_kwargs", "config_kwargs", "use_ssl",
                    "version_aware", "skip_instance_cache", "use_listings_cache", "listings_expiry_time",
                    "max_paths"})

#: the plain botocore client of each s3fs filesystem, made once per process (pid, client)
_CLIENTS: weakref.WeakKeyDictionary[Any, tuple[int, Any]] = weakref.WeakKeyDictionary()
_CLIENTS_LOCK = threading.Lock()


@dataclass(frozen=True)
class StoreFile:
    """An object-store file checked to exist and fit the size limit, to be opened where it lies:
    PyAV then reads only the byte ranges it decodes (a video's sampled frames)."""

    fs: Any
    path: str
    shown: str

    def open(self) -> Any:
        """A seekable binary file object (fsspec's, reading in ranges)."""
        return self.fs.open(self.path, "rb")


def filesystem(url: str) -> tuple[Any, str]:
    """`url`'s fsspec filesystem and its path there: the one place media build a store client.
    A scheme we do not read, or one whose backend is not installed, is 415."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in STORES:
        raise load_error(f"unsupported URL scheme {scheme}://; supported: {SUPPORTED_SOURCES}, and object stores "
                         f"({', '.join(sorted(STORES))}) whose fsspec backend is installed", "media.unsupported_scheme")
    options = client_options(scheme)  # outside the try: a bad MMENC_STORE_* value is no unsupported scheme
    try:
        import fsspec

        return fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as exc:  # no such protocol, or its package is missing
        raise load_error(f"unsupported URL scheme {scheme}://; supported: {SUPPORTED_SOURCES}, and fsspec URLs "
                         f"whose backend is installed ({exc})", "media.unsupported_scheme", exc) from exc


def client_options(scheme: str) -> dict[str, Any]:
    """The store client's options for media: the same bounded timeouts and retries as the output's
    (`output.objectstore.client_options`), and for S3 a connection per GET in flight."""
    from ..output.objectstore import client_options as bounded  # here: a worker that reads no store never imports it

    options = dict(bounded(scheme, None))
    if scheme in ("s3", "s3a"):
        options["config_kwargs"] = {"max_pool_connections": POOL_CONNECTIONS, **options.get("config_kwargs", {})}
    return options


def is_s3(fs: Any) -> bool:
    """True for s3fs's filesystem: its objects are read with one GetObject each (`get_object`)."""
    s3fs = sys.modules.get("s3fs")  # not imported: no filesystem of its
    return s3fs is not None and isinstance(fs, s3fs.S3FileSystem)


def read_fsspec(url: str, cfg: MediaConfig) -> bytes:
    """The bytes of `url` through its fsspec backend, size-checked before reading: in S3 one GET."""
    fs, inner = filesystem(url)
    shown = str(describe_source(url))
    if is_s3(fs):
        from fsspec.asyn import sync

        return sync(fs.loop, get_object, fs, inner, cfg, shown)
    found = checked(fs, inner, cfg, shown)
    try:
        with found.open() as fh:
            data = fh.read(cfg.max_file_bytes + 1)
    except OSError as exc:
        raise store_error(exc, found.shown) from exc
    except Exception as exc:  # the store client's own errors, as above
        raise client_error(exc, found.shown) from exc
    return check_payload(data, cfg, found.shown)


async def get_object(fs: Any, path: str, cfg: MediaConfig, shown: str, reserve: Reserve | None = None) -> bytes:
    """One GetObject of `path` in s3fs's `fs` (run on its event loop): empty or over the size limit
    by the answer's Content-Length, the body left unread; else its bytes, once `reserve` (if any)
    grants their size. A missing key that is a folder's prefix says so (one more request, on failure only)."""
    bucket, key, version = fs.split_path(path)
    try:
        answer = await fs._call_s3("get_object", Bucket=bucket, Key=key, **({"VersionId": version} if version else {}))
    except FileNotFoundError as exc:
        raise await _missing(fs, path, shown, exc) from exc
    except OSError as exc:
        raise store_error(exc, shown) from exc
    except Exception as exc:  # botocore's own errors (no credentials, endpoint unreachable)
        raise client_error(exc, shown) from exc
    body = answer["Body"]
    try:
        size = answer_size(answer, cfg, shown)
        if reserve is not None:
            await reserve(size)
        data = await body.read(cfg.max_file_bytes + 1)  # +1: a body longer than its header still fails
    except MMError:
        raise
    except OSError as exc:
        raise store_error(exc, shown) from exc
    except Exception as exc:  # the connection broke while reading (aiohttp's errors): worth a later retry
        raise client_error(exc, shown) from exc
    finally:
        body.close()  # unread bytes are dropped with the connection, never read
    return check_payload(data, cfg, shown)


async def _missing(fs: Any, path: str, shown: str, exc: OSError) -> MMError:
    """The error of a key that does not exist: a folder (its prefix holds objects), else 404."""
    try:
        folder = await fs._isdir(path)
    except Exception:  # the listing failed too: the GET's answer stands
        folder = False
    return missing_error(folder, shown, exc)


def missing_error(folder: bool, shown: str, exc: OSError) -> MMError:
    """A key that does not exist: `folder` when its prefix holds objects, else 404."""
    if folder:
        return load_error(f"{shown} is a directory, not a media file", "media.is_directory")
    return store_error(exc, shown)


def blocking_client(fs: Any) -> Any | None:
    """A plain botocore S3 client (thread-safe, blocking) with s3fs `fs`'s credentials, endpoint,
    timeouts and retries, one per filesystem and process; None where botocore cannot be imported
    or `fs` was given options it does not map (`MAPPED`): such images are read through s3fs."""
    if any(value for key, value in fs.storage_options.items() if key not in MAPPED):
        return None
    try:
        import botocore.session
        from botocore.config import Config
    except ImportError:
        return None
    with _CLIENTS_LOCK:  # making a client is not thread-safe; using one is
        made = _CLIENTS.get(fs)
        if made is None or made[0] != os.getpid():  # a client does not survive a fork
            given = {"aws_access_key_id": fs.key, "aws_secret_access_key": fs.secret,
                     "aws_session_token": fs.token, "endpoint_url": fs.endpoint_url, "use_ssl": fs.use_ssl}
            init = {k: v for k, v in given.items() if v is not None}
            init.update(fs.client_kwargs)  # as s3fs: its client_kwargs win
            config = {**fs.config_kwargs, "connect_timeout": fs.config_kwargs.get("connect_timeout", fs.connect_timeout),
                      "read_timeout": fs.config_kwargs.get("read_timeout", fs.read_timeout)}
            client = botocore.session.get_session().create_client("s3", config=Config(**config), **init)
            made = _CLIENTS[fs] = (os.getpid(), client)
    return made[1]


def fetch_object(client: Any, fs: Any, path: str, cfg: MediaConfig, shown: str,
                 reserve: Callable[[int], None] | None = None) -> bytes:
    """`get_object` with the plain botocore `client` (`blocking_client`), on the calling thread: one
    GetObject, empty or over the size limit by its Content-Length with the body unread, else its bytes
    once `reserve` (if any) grants their size."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    bucket, key, version = fs.split_path(path)
    try:
        answer = client.get_object(Bucket=bucket, Key=key, **({"VersionId": version} if version else {}))
    except ClientError as exc:  # the store's answer, as s3fs turns it into an OSError (NoSuchKey: FileNotFoundError)
        error = translate_boto_error(exc)
        if os_reason(error) == "media.not_found":  # a missing key (or a folder's prefix)
            raise missing_error(_is_folder(fs, path), shown, error) from exc
        raise store_error(error, shown) from exc
    except Exception as exc:  # botocore's own errors (no credentials, endpoint unreachable)
        raise client_error(exc, shown) from exc
    body = answer["Body"]
    try:
        size = answer_size(answer, cfg, shown)
        if reserve is not None:
            reserve(size)
        data = body.read(cfg.max_file_bytes + 1)  # +1: a body longer than its header still fails
    except MMError:
        raise
    except OSError as exc:
        raise store_error(exc, shown) from exc
    except Exception as exc:  # the connection broke while reading (urllib3's errors): worth a later retry
        raise client_error(exc, shown) from exc
    finally:
        body.close()  # unread bytes are dropped with the connection, never read
    return check_payload(data, cfg, shown)


def _is_folder(fs: Any, path: str) -> bool:
    try:
        return bool(fs.isdir(path))
    except Exception:  # the listing failed too: the GET's answer stands
        return False


def answer_size(answer: dict[str, Any], cfg: MediaConfig, shown: str) -> int:
    """A GetObject answer's Content-Length, checked: not empty, within the size limit."""
    size = int(answer.get("ContentLength") or 0)
    if size == 0:
        raise load_error(f"{shown} is empty", "media.empty")
    check_size(size, cfg, shown)
    return size


def store_file(url: str, cfg: MediaConfig) -> StoreFile:
    """`url`'s file in its fsspec backend, checked (scheme, backend, existence, size) but not read."""
    fs, inner = filesystem(url)
    return checked(fs, inner, cfg, str(describe_source(url)))


def checked(fs: Any, inner: str, cfg: MediaConfig, shown: str) -> StoreFile:
    """A file in `fs` checked to exist, be a file, not be empty and fit the size limit (`fs.info`)."""
    try:
        entry = fs.info(inner)
    except OSError as exc:
        raise store_error(exc, shown) from exc
    except Exception as exc:  # the store client's own errors (no credentials, no endpoint), not OSErrors
        raise client_error(exc, shown) from exc
    if entry.get("type") == "directory":
        raise load_error(f"{shown} is a directory, not a media file", "media.is_directory")
    size = int(entry.get("size") or 0)
    if size == 0:
        raise load_error(f"{shown} is empty", "media.empty")
    check_size(size, cfg, shown)
    return StoreFile(fs, inner, shown)


def store_error(exc: OSError, shown: str | None) -> MMError:
    """A failure of the store as the load error it means (`errors.OS_REASONS`); one the table says
    nothing of is the store's, worth a later retry."""
    reason = os_reason(exc) or "remote.unavailable"
    if reason == "media.not_found":
        return load_error(f"{shown} does not exist", reason, exc)
    if reason == "media.permission_denied":
        return load_error(f"{shown} is not readable for us: {exc}", reason, exc)
    return load_error(f"cannot read {shown}: {exc}", reason, exc)


def client_error(exc: BaseException, shown: str | None) -> MMError:
    """A store client's own error (not an OSError: botocore's, aiohttp's) as a load error."""
    return load_error(f"cannot read {shown}: {type(exc).__name__}: {exc}", client_reason(exc), exc)
