"""Media in object stores, through fsspec (`STORES`: `s3://`, `gs://`, `az://`, `hf://`, ...)
where the matching backend is installed; any other scheme (ftp://, ...) is one we do not fetch
(415, naming the package to install where one would do)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import MediaConfig
from ..errors import MMError, client_reason, os_reason
from .sources import SUPPORTED_SOURCES, check_payload, check_size, describe_source, load_error

#: the URL schemes read through fsspec (object stores, the Hugging Face hub, fsspec's memory store)
STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "hf", "memory", "file", "local"})


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


def read_fsspec(url: str, cfg: MediaConfig) -> bytes:
    """The bytes of `url` through its fsspec backend, size-checked before reading."""
    found = store_file(url, cfg)
    try:
        with found.open() as fh:
            data = fh.read(cfg.max_file_bytes + 1)
    except OSError as exc:
        raise store_error(exc, found.shown) from exc
    except Exception as exc:  # the store client's own errors, as above
        raise load_error(f"cannot read {found.shown}: {type(exc).__name__}: {exc}", client_reason(exc), exc) from exc
    return check_payload(data, cfg, found.shown)


def store_file(url: str, cfg: MediaConfig) -> StoreFile:
    """`url`'s file in its fsspec backend, checked (scheme, backend, existence, size) but not read."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in STORES:
        raise load_error(f"unsupported URL scheme {scheme}://; supported: {SUPPORTED_SOURCES}, and object stores "
                         f"({', '.join(sorted(STORES))}) whose fsspec backend is installed", "media.unsupported_scheme")
    try:
        import fsspec

        fs, inner = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:  # no such protocol, or its package is missing
        raise load_error(f"unsupported URL scheme {scheme}://; supported: {SUPPORTED_SOURCES}, and fsspec URLs "
                         f"whose backend is installed ({exc})", "media.unsupported_scheme", exc) from exc
    shown = describe_source(url)
    try:
        entry = fs.info(inner)
    except OSError as exc:
        raise store_error(exc, shown) from exc
    except Exception as exc:  # the store client's own errors (no credentials, no endpoint), not OSErrors
        raise load_error(f"cannot read {shown}: {type(exc).__name__}: {exc}", client_reason(exc), exc) from exc
    if entry.get("type") == "directory":
        raise load_error(f"{shown} is a directory, not a media file", "media.is_directory")
    size = int(entry.get("size") or 0)
    if size == 0:
        raise load_error(f"{shown} is empty", "media.empty")
    check_size(size, cfg, shown)
    return StoreFile(fs, inner, str(shown))


def store_error(exc: OSError, shown: str | None) -> MMError:
    """A failure of the store as the load error it means (`errors.OS_REASONS`); one the table says
    nothing of is the store's, worth a later retry."""
    reason = os_reason(exc) or "remote.unavailable"
    if reason == "media.not_found":
        return load_error(f"{shown} does not exist", reason, exc)
    if reason == "media.permission_denied":
        return load_error(f"{shown} is not readable for us: {exc}", reason, exc)
    return load_error(f"cannot read {shown}: {exc}", reason, exc)
