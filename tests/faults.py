"""Corpora of broken and of valid-but-unusual media, built in a folder with Pillow and raw bytes.

`build_fault_corpus` pairs each broken source with the `MMError` it must produce;
`build_good_corpus` lists sources that must decode to RGB with the size in `GOOD_SIZES`. Both are
reused by end-to-end tests (write the sources into a manifest whose folder is `dir`). Sources are
what a manifest's `image` field holds: a path relative to `dir`, a URL or a data URI.

The "refused" case fetches a loopback port nobody listens on: run it with a `MediaConfig` with a
small `fetch_timeout`, `fetch_retries=1` and (in-process) a tiny `backoff`, or it retries for real.
"""

from __future__ import annotations

import base64
import io
import os
import socket
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw


@dataclass(frozen=True)
class FaultCase:
    """A broken source and the error it must produce."""

    source: str
    code: int
    reason: str
    stage: str


#: (width, height) each good case must decode to (after EXIF orientation).
GOOD_SIZES: dict[str, tuple[int, int]] = {
    "cmyk_jpeg": (32, 24),
    "gray16_png": (64, 16),
    "rgb16_png": (8, 4),
    "palette_png": (20, 10),  # left square colour 1, rest colour 0 (black)
    "palette_transparent_png": (20, 10),  # colour 0 transparent: white once composited
    "rgba_png": (16, 8),  # left half opaque red, right half transparent black
    "la_png": (16, 8),
    "one_bit_png": (9, 7),
    "gray_jpeg": (30, 20),
    "one_pixel_png": (1, 1),
    "exif_rotated_jpeg": (20, 40),  # stored 40x20 with orientation 6; upright: red top, green bottom
    "very_wide_png": (4000, 10),
    "animated_gif": (10, 10),
    "multipage_tiff": (12, 8),  # first page; the second is 30x30
    "webp": (24, 16),
    "bmp": (24, 16),
    "tiff": (24, 16),
    "data_uri_png": (5, 4),
}


def png_bytes(width: int, height: int, bit_depth: int, color_type: int, raw: bytes,
              *, extra_idat: bytes | None = None) -> bytes:
    """A PNG from raw scanlines (each already prefixed by its filter byte), written by hand so we
    can declare any size or bit depth without Pillow holding the pixels."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    idat = extra_idat if extra_idat is not None else zlib.compress(raw, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def bomb_png(side: int = 20_000) -> bytes:
    """A valid 1-bit PNG of side x side pixels (400 megapixels by default) in ~50 KB."""
    row = b"\0" * (1 + (side + 7) // 8)
    z = zlib.compressobj(9)
    step = 1000
    idat = b"".join(z.compress(row * min(step, side - i)) for i in range(0, side, step)) + z.flush()
    return png_bytes(side, side, 1, 0, b"", extra_idat=idat)


def free_loopback_port() -> int:
    """A loopback TCP port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _save(im: Image.Image, fmt: str, **params) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def _noise(size: tuple[int, int]) -> Image.Image:
    """A deterministic busy RGB image, so compressed files have real data to truncate."""
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def build_fault_corpus(dir: Path) -> dict[str, FaultCase]:
    """Write broken media into `dir`; return name -> case (source relative to `dir`)."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    jpeg = _save(_noise((64, 64)), "JPEG", quality=90)
    png = _save(_noise((32, 32)), "PNG")
    files: dict[str, bytes] = {
        "truncated.jpg": jpeg[: len(jpeg) * 3 // 5],
        "empty.png": b"",
        "notes.jpg": b"this is not an image, just some text\n" * 8,
        "corrupt.png": png[:33] + b"\x13\x37garbage after the header" * 20,  # signature + IHDR kept
        "bad_crc.png": png[:60] + bytes([png[60] ^ 0xFF]) + png[61:],  # inside IDAT, CRC now wrong
        "bomb.png": bomb_png(),
        "photo.heic": struct.pack(">I", 24) + b"ftypheic" + b"\0\0\0\0mif1heic" + b"\0" * 64,
        "drawing.svg": b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" '
                       b'width="10" height="10"><rect width="10" height="10"/></svg>\n',
    }
    for name, data in files.items():
        (dir / name).write_bytes(data)
    (dir / "folder.jpg").mkdir(exist_ok=True)

    load, decode = "load", "decode"
    cases = {
        "truncated_jpeg": FaultCase("truncated.jpg", 400, "media.unreadable", decode),
        "empty_file": FaultCase("empty.png", 400, "media.empty", load),
        "not_an_image": FaultCase("notes.jpg", 400, "media.unreadable", decode),
        "corrupt_png": FaultCase("corrupt.png", 400, "media.unreadable", decode),
        "bad_crc_png": FaultCase("bad_crc.png", 400, "media.unreadable", decode),
        "decompression_bomb": FaultCase("bomb.png", 413, "media.too_large", decode),
        "heic_without_plugin": FaultCase("photo.heic", 415, "media.unsupported_format", decode),
        "svg": FaultCase("drawing.svg", 415, "media.unsupported_format", decode),
        "directory": FaultCase("folder.jpg", 400, "media.is_directory", load),
        "missing": FaultCase("missing.jpg", 404, "media.not_found", load),
        "path_through_file": FaultCase("notes.jpg/inner.jpg", 404, "media.not_found", load),
        "bad_base64": FaultCase("data:image/png;base64,iVBORw0KGgo*not*base64!", 400,
                                "media.bad_base64", load),
        "bad_data_uri": FaultCase("data:image/png;base64", 400, "media.bad_data_uri", load),
        "data_uri_not_image": FaultCase("data:text/plain;base64,aGVsbG8=", 415,
                                        "media.unsupported_format", load),
        "empty_data_uri": FaultCase("data:image/png;base64,", 400, "media.empty", load),
        "ftp_scheme": FaultCase("ftp://example.com/x.jpg", 415, "media.unsupported_scheme", load),
        "store_without_backend": FaultCase("gs://bucket/key.jpg", 415, "media.unsupported_scheme", load),
        "refused": FaultCase(f"http://127.0.0.1:{free_loopback_port()}/x.jpg", 503,
                             "remote.unavailable", load),
    }
    if os.geteuid() != 0:  # root reads any file, so the case only exists for other users
        locked = dir / "locked.png"
        locked.write_bytes(png)
        locked.chmod(0)
        cases["permission_denied"] = FaultCase("locked.png", 403, "media.permission_denied", load)
    return cases


def build_good_corpus(dir: Path) -> dict[str, str]:
    """Write valid but unusual media into `dir`; return name -> source (see `GOOD_SIZES`)."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)

    palette = Image.new("P", (20, 10), 0)
    palette.putpalette([0, 0, 0, 200, 0, 0] + [0] * (254 * 3))  # index 0: black
    ImageDraw.Draw(palette).rectangle((0, 0, 9, 9), fill=1)
    rgba = Image.new("RGBA", (16, 8), (0, 0, 0, 0))  # right half: transparent black
    rgba.paste((255, 0, 0, 255), (0, 0, 8, 8))
    la = Image.new("LA", (16, 8), (0, 0))
    la.paste((40, 255), (0, 0, 8, 8))
    one_bit = Image.new("1", (9, 7), 0)
    one_bit.putpixel((0, 0), 1)
    gray16 = np.tile(np.linspace(0, 65535, 64).round().astype(np.uint16), (16, 1))
    rgb16 = b"".join(b"\0" + struct.pack(">HHH", 0x8080, 0xFFFF, 0x0000) * 8 for _ in range(4))
    rotated = Image.new("RGB", (40, 20), (0, 128, 0))
    rotated.paste((255, 0, 0), (0, 0, 20, 20))  # stored left half: the top half once upright
    exif = Image.Exif()
    exif[0x0112] = 6
    frames = [Image.new("P", (10, 10), 0), Image.new("P", (10, 10), 1)]
    for frame in frames:
        frame.putpalette([255, 0, 0, 0, 0, 255] + [0] * (254 * 3))
    pages = [Image.new("RGB", (12, 8), (10, 20, 30)), Image.new("RGB", (30, 30), (200, 0, 0))]
    small = _noise((24, 16))

    files: dict[str, tuple[str, bytes]] = {
        "cmyk_jpeg": ("cmyk.jpg", _save(Image.new("CMYK", (32, 24), (0, 255, 255, 0)), "JPEG")),
        "gray16_png": ("gray16.png", _save(Image.fromarray(gray16), "PNG")),
        "rgb16_png": ("rgb16.png", png_bytes(8, 4, 16, 2, rgb16)),
        "palette_png": ("palette.png", _save(palette, "PNG")),
        "palette_transparent_png": ("palette_transparent.png", _save(palette, "PNG", transparency=0)),
        "rgba_png": ("rgba.png", _save(rgba, "PNG")),
        "la_png": ("la.png", _save(la, "PNG")),
        "one_bit_png": ("one_bit.png", _save(one_bit, "PNG")),
        "gray_jpeg": ("gray.jpg", _save(Image.new("L", (30, 20), 77), "JPEG")),
        "one_pixel_png": ("one_pixel.png", _save(Image.new("RGB", (1, 1), (1, 2, 3)), "PNG")),
        "exif_rotated_jpeg": ("rotated.jpg", _save(rotated, "JPEG", exif=exif.tobytes())),
        "very_wide_png": ("wide.png", _save(Image.new("RGB", (4000, 10), (9, 9, 9)), "PNG")),
        "animated_gif": ("animated.gif", _save(frames[0], "GIF", save_all=True,
                                               append_images=frames[1:], duration=50, loop=0)),
        "multipage_tiff": ("multipage.tiff", _save(pages[0], "TIFF", save_all=True,
                                                   append_images=pages[1:])),
        "webp": ("image.webp", _save(small, "WEBP", quality=80)),
        "bmp": ("image.bmp", _save(small, "BMP")),
        "tiff": ("image.tiff", _save(small, "TIFF", compression="tiff_lzw")),
    }
    sources = {}
    for name, (filename, data) in files.items():
        (dir / filename).write_bytes(data)
        sources[name] = filename
    tiny = _save(Image.new("RGB", (5, 4), (0, 0, 255)), "PNG")
    sources["data_uri_png"] = "data:image/png;base64," + base64.b64encode(tiny).decode()
    return sources
