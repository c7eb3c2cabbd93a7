"""Bytes to pixels (stage "decode"): identify, size-check, fully decode and normalise to RGB with Pillow.

See the package docstring for what "RGB" means here (EXIF orientation, alpha on white, high bit
depths scaled). Formats Pillow does not open here are told apart from corrupt bytes: a format we do
not support is 415, a codec our install should have is 500, truncated or corrupt bytes are 400.
"""

from __future__ import annotations

import functools
import io
import re
import struct
import warnings
import zlib
from typing import Callable

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from ..config import MediaConfig
from ..encoders.base import REDUCED
from ..errors import MMError, classify, trim_message

#: Formats Pillow could open that we refuse: EPS runs Ghostscript on untrusted input.
EXCLUDED_FORMATS = frozenset({"EPS"})


#: Codecs every sane Pillow build has: lacking one is our install's fault (500), not the input's.
EXPECTED_CODECS = frozenset({"WEBP", "JPEG", "ZLIB", "PNG"})


_WHITE = (255, 255, 255, 255)


_HEIF_BRANDS = {"heic": "HEIC", "heix": "HEIC", "hevc": "HEIC", "hevx": "HEIC", "heim": "HEIC",
                "heis": "HEIC", "mif1": "HEIF", "msf1": "HEIF", "avif": "AVIF", "avis": "AVIF"}


# Pillow's own wording for these cases; matched so the code/reason do not depend on exception types.
_DECODER_MISSING = re.compile(r"(?:decoder|encoder) \S+ not available")


_NOT_INSTALLED = re.compile(r"because (\w+) support not installed")


_TOO_BIG_CHUNK = re.compile(r"decompressed data too large", re.IGNORECASE)


# Exceptions Pillow raises on corrupt or truncated input (it uses all of these in its plugins).
_CORRUPT = (OSError, SyntaxError, EOFError, ValueError, struct.error, zlib.error, IndexError)


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


#: (width, height) of an upright image -> the size to decode a JPEG of it at, or None: see `decode_image`
Draft = Callable[[int, int], "tuple[int, int] | None"]


def decode_image(data: bytes, cfg: MediaConfig, content_type: str | None, draft: Draft | None = None) -> Image.Image:
    """Identify, size-check, decode and normalise to RGB. Never mutates Pillow globals.

    With `draft`, a JPEG may be decoded at a reduced DCT scale (1/2, 1/4, 1/8: `Image.draft`) no
    smaller than the size `draft` asks for: several times faster, close to but not the same pixels
    as full decoding (`--decode fast`)."""
    try:
        im = Image.open(io.BytesIO(data), formats=_formats())
        _check_size(*im.size, cfg)
        if draft is not None and im.format == "JPEG":
            _reduce(im, draft)
        im.load()  # decodes now, so truncation fails here and not in the encoder
        _apply_orientation(im)
        rgb = _to_rgb(im)
    except MMError:
        raise
    except Exception as exc:
        raise _decode_error(exc, data, content_type) from exc
    # Detach from the reader (a multi-frame file keeps its buffer for seeking) without copying
    # the pixels: a plain Image on the same decoded core.
    return rgb._new(rgb.im) if isinstance(rgb, ImageFile.ImageFile) else rgb


def _check_size(width: int, height: int, cfg: MediaConfig) -> None:
    """The header's size against --max-image-pixels, before any pixel is decoded."""
    if width * height > cfg.max_image_pixels:
        raise MMError(f"image is {width}x{height} = {width * height} pixels, over the "
                      f"--max-image-pixels limit of {cfg.max_image_pixels}", stage="decode",
                      reason="media.too_large")
    if width <= 0 or height <= 0:
        raise MMError(f"image has no pixels ({width}x{height})", stage="decode", reason="media.unreadable")


def device_jpeg(data: bytes, cfg: MediaConfig) -> bool:
    """True when `data` is a JPEG the device may decode as it is (`--decode gpu`): a readable
    header within the pixel limit, RGB or grey, upright (no EXIF rotation: the device decoder
    ignores it). Anything else decodes on the CPU; an image over the limit raises (413)."""
    if not data.startswith(b"\xff\xd8\xff"):
        return False
    try:
        im = Image.open(io.BytesIO(data), formats=("JPEG",))
        orientation = im.getexif().get(0x0112, 1)
    except Exception:  # the CPU decoder says what is wrong with it
        return False
    _check_size(*im.size, cfg)
    return im.mode in ("RGB", "L") and orientation in (None, 1)


def _reduce(im: Image.Image, draft: Draft) -> None:
    """Ask the JPEG decoder for the reduced scale the preprocessor wants for the upright image
    (EXIF orientations 5-8 swap the sides); a reduced image records its full size and the box of
    it that the full image covers, both upright (`REDUCED`)."""
    try:
        orientation = im.getexif().get(0x0112)
    except Exception:  # a broken EXIF block: `_apply_orientation` ignores it too
        orientation = None
    axes = _UPRIGHT_AXES.get(orientation, _UPRIGHT_AXES[1])
    full = im.size
    need = draft(*(full[axes[0][0]], full[axes[1][0]]))
    if need is None:
        return
    asked = (need[0], need[1]) if axes[0][0] == 0 else (need[1], need[0])
    reduced = im.draft(im.mode, asked)
    if reduced is None:
        return
    covered = reduced[1][2:]  # the box of the reduced image the full one covers starts at (0, 0)
    spans = []
    for source, flipped in axes:  # upright x, then y: which source axis, mirrored or not
        end, size = covered[source], im.size[source]
        spans.append((size - end, size) if flipped else (0.0, end))
    im.info[REDUCED] = ((full[axes[0][0]], full[axes[1][0]]), (spans[0][0], spans[1][0], spans[0][1], spans[1][1]))


#: EXIF orientation -> for the upright image's x and y: (the stored image's axis, 0 = x, 1 = y;
#: mirrored), as Pillow's `exif_transpose` turns it
_UPRIGHT_AXES = {1: ((0, False), (1, False)), 2: ((0, True), (1, False)), 3: ((0, True), (1, True)),
                 4: ((0, False), (1, True)), 5: ((1, False), (0, False)), 6: ((1, True), (0, False)),
                 7: ((1, True), (0, True)), 8: ((1, False), (0, True))}


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
