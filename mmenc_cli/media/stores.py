"""Images in object stores, through fsspec (`STORES`: `s3://`, `gs://`, `az://`, `hf://`, ...)
where the matching backend is installed; any other scheme (ftp://, ...) is one we do not fetch
(415, naming the package to install where one would do)."""

from __future__ import annotations

from ..config import MediaConfig
from ..errors import MMError
from .sources import SUPPORTED_SOURCES, check_payload, check_size, describe_source, load_error


#: the URL schemes read through fsspec (object stores, the Hugging Face hub, fsspec's memory store)
STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "hf", "memory", "file", "local"})


def read_fsspec(url: str, cfg: MediaConfig) -> bytes:
    """The bytes of `url` through its fsspec backend, size-checked before reading."""
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
        if entry.get("type") == "directory":
            raise load_error(f"{shown} is a directory, not an image file", "media.is_directory")
        check_size(int(entry.get("size") or 0), cfg, shown)
        with fs.open(inner, "rb") as fh:
            data = fh.read(cfg.max_file_bytes + 1)
    except MMError:
        raise
    except FileNotFoundError as exc:
        raise load_error(f"{shown} does not exist", "media.not_found", exc) from exc
    except PermissionError as exc:
        raise load_error(f"{shown} is not readable for us: {exc}", "media.permission_denied", exc) from exc
    except OSError as exc:  # the store is unreachable: worth a later retry
        raise load_error(f"cannot read {shown}: {exc}", "remote.unavailable", exc) from exc
    return check_payload(data, cfg, shown)
