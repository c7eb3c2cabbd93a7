"""Loading one image, audio or video clip from a manifest's value, inside a decode worker process.

Modules: `sources.py` gets the bytes of a path, `file://` URL, data URI or inline bytes;
`http.py` fetches `http(s)://` with retries; `decode.py` turns bytes into RGB pixels (Pillow);
`clips.py` opens audio and video with PyAV, `audio.py` decodes samples, `video.py` samples frames;
`stores.py` reads object stores (an S3 image is one GET) and `ahead.py` fetches a chunk's S3
images at once (`fetch_ahead`; `load_image` then takes a `Fetched` in place of the URL).
Audio and video on a local path or in a store are opened where they lie (`load_clip`), not read
into memory.

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

import os
from typing import Any, Sequence

from PIL import Image

from ..config import MediaConfig
from ..errors import MMError
from . import http
from .ahead import FetchAhead, Fetched
from .decode import Draft, configure_pillow, decode_image
from .ranged import HttpClip
from .sources import (
    SCHEME,
    Source,
    check_file,
    check_payload,
    data_uri_bytes,
    describe_source,
    file_url_path,
    guard,
    load_error,
    read_file,
)
from .stores import StoreFile, read_fsspec, store_file

__all__ = ["FetchAhead", "Fetched", "configure_pillow", "describe_source", "fetch_ahead", "load_clip", "load_encoded", "load_image"]


def load_image(source: Source | Fetched, base_dir: str, cfg: MediaConfig, *,
               backoff: float | None = None, draft: Draft | None = None) -> Image.Image:
    """Load, decode and normalise one image to a fully loaded RGB `PIL.Image`.

    `base_dir` resolves relative paths (the manifest's folder). `backoff` overrides
    `BACKOFF_BASE_S` (tests use a tiny one). Every failure is an `MMError` (see module docstring).
    """
    data, content_type = load_encoded(source, base_dir, cfg, backoff=backoff)
    return guard("decode", decode_image, data, cfg, content_type, draft)


def load_encoded(source: Source | Fetched, base_dir: str, cfg: MediaConfig, *,
                 backoff: float | None = None) -> tuple[bytes, str | None]:
    """The encoded bytes of one image and their declared media type; failures as in `load_image`."""
    return guard("load", load_bytes, source, base_dir, cfg, http.BACKOFF_BASE_S if backoff is None else backoff)


def load_clip(source: Source, base_dir: str, cfg: MediaConfig, *,
              backoff: float | None = None) -> str | bytes | StoreFile | HttpClip:
    """An audio or video clip for PyAV: the checked path of a local file, an object-store file or
    an http(s) URL (opened where it lies, so only what is decoded is read: `ranged.py`), else its
    bytes (data URIs, inline bytes). Failures as in `load_image`, stage "load"."""
    kind, where = guard("load", locate, source, base_dir)
    if kind == "path":
        guard("load", check_file, where, cfg)
        return where
    if kind == "store":
        return guard("load", store_file, where, cfg)
    if kind == "http":
        return HttpClip(where, cfg, http.BACKOFF_BASE_S if backoff is None else backoff, str(describe_source(where)))
    return load_encoded(source, base_dir, cfg, backoff=backoff)[0]


def locate(source: Source, base_dir: str) -> tuple[str, str]:
    """Where a source's bytes are: ("path", a local file), ("store", an fsspec URL, a relative path
    below one included), ("http", a URL) or ("inline", ""): bytes, a data URI, or a value that is
    not a source (the loaders say what is wrong with it)."""
    if not isinstance(source, str) or not source.strip() or source[:5].lower() == "data:":
        return "inline", ""
    match = SCHEME.match(source)
    if match is None:
        if SCHEME.match(base_dir):  # a relative path in a folder or manifest behind an fsspec URL
            return "store", base_dir.rstrip("/") + "/" + source
        return "path", os.path.join(base_dir, os.path.expanduser(source))
    scheme = match.group(1).lower()
    if scheme == "file":
        return "path", file_url_path(source)
    return ("http" if scheme in ("http", "https") else "store"), source


def fetch_ahead(sources: Sequence[tuple[Any, str]], cfg: MediaConfig, budget_bytes: int) -> FetchAhead:
    """The images among `sources` ((source, base_dir) each) that are S3 objects, all asked for at
    once, their bodies within `budget_bytes` (`ahead.py`); take each by its position."""
    urls = {}
    for position, (source, base_dir) in enumerate(sources):
        try:
            kind, where = locate(source, base_dir)
        except MMError:  # loaded in place, where the same error is raised
            continue
        if kind == "store":
            urls[position] = where
    return FetchAhead(urls, cfg, budget_bytes)


def load_bytes(source: Source | Fetched, base_dir: str, cfg: MediaConfig,
               backoff: float) -> tuple[bytes, str | None]:
    """The raw bytes of `source` and, where known, their declared media type."""
    if isinstance(source, Fetched):  # fetched ahead: its bytes, checked, or its fetch's error
        return source.payload(), None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return check_payload(bytes(source), cfg, "inline image bytes"), None
    if not isinstance(source, str) or not source.strip():
        got = "an empty string" if isinstance(source, str) else type(source).__name__
        raise load_error(f"the image field must be a path, URL, data URI or bytes, got {got}",
                         "media.invalid_source")
    if source[:5].lower() == "data:":
        return data_uri_bytes(source, cfg)
    kind, where = locate(source, base_dir)
    if kind == "path":
        return read_file(where, cfg), None
    if kind == "http":
        return http.fetch(where, cfg, backoff)
    return read_fsspec(where, cfg), None
