"""Opening an audio or video file with PyAV (`av`), and what its failures mean (stage "decode").

PyAV is FFmpeg's Python binding: one library for every container and codec mmenc reads (WAV,
FLAC, MP3, Ogg/Opus, MP4, WebM, ...). It probes by content, so a wrong file extension does not
matter. It is the `mmenc[av]` extra; `require_av` is the startup check that names it.

Errors: bytes FFmpeg cannot parse, or a stream that yields nothing, are the input's fault (400
`media.unreadable`); a stream whose codec FFmpeg here has no decoder for is 415
(`media.unsupported_format`); a file without the stream asked for (a clip with no audio track) is
422 (`media.no_stream`).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Iterator

from ..errors import MMError, ModelLoadError, trim_message
from .ranged import HttpClip
from .sources import file_error
from .stores import StoreFile, store_error

#: what a missing PyAV install says (a run with audio or video items stops at start, exit 3)
AV_EXTRA = 'audio and video need PyAV: pip install "mmenc[av]"'


def require_av() -> str:
    """PyAV's version; ModelLoadError naming the extra when PyAV is not installed."""
    try:
        import av
    except ImportError as exc:
        raise ModelLoadError(f"{AV_EXTRA} ({exc})") from exc
    return str(av.__version__)


def decode_error(message: str, reason: str = "media.unreadable", exc: BaseException | None = None) -> MMError:
    """An MMError at stage "decode"."""
    return MMError(trim_message(message), stage="decode", reason=reason,
                   error=type(exc).__name__ if exc is not None else None)


@contextlib.contextmanager
def open_media(source: str | bytes | StoreFile | HttpClip) -> Iterator[Any]:
    """An open PyAV input container for a local path, an object-store file or URL (read in
    ranges) or in-memory bytes; every failure inside the block (opening, demuxing, decoding) becomes its
    MMError: FFmpeg's as the media's fault, the store's (a read that fails) as unavailable. A read
    that failed is the item's error even where FFmpeg took it for the file's end."""
    import av

    with contextlib.ExitStack() as stack:
        kept: GuardedFile | None = None
        try:
            if isinstance(source, (StoreFile, HttpClip)):
                kept = GuardedFile(stack.enter_context(source.open()))
                fh: Any = kept
            else:
                fh = source if isinstance(source, str) else io.BytesIO(source)
            container = stack.enter_context(av.open(fh, mode="r", metadata_errors="ignore"))
            yield container
            if kept is not None and kept.failed is not None:
                raise kept.failed
        except Exception as exc:
            failed = kept.failed if kept is not None and kept.failed is not None else exc
            if isinstance(failed, MMError):
                if failed is exc:
                    raise
                raise failed from exc
            if isinstance(source, StoreFile) and not isinstance(failed, (av.error.FFmpegError, MemoryError)):
                # not FFmpeg's: the store failed a read (OSError, or its client library's own error)
                if isinstance(failed, OSError):
                    raise store_error(failed, source.shown) from failed
                raise MMError(trim_message(f"cannot read {source.shown}: {failed}"), stage="load",
                              reason="remote.unavailable", error=type(failed).__name__) from failed
            # PyAV's errors are OSErrors too: a local file gone or unreadable is that, not corrupt media
            found = file_error(failed) if isinstance(source, str) and isinstance(failed, OSError) else None
            raise (found or _av_error(failed)) from failed


class GuardedFile(io.RawIOBase):
    """A Python file handed to FFmpeg (an object-store file, a URL read in ranges) whose failures
    never reach PyAV: the first is kept (`failed`, raised by `open_media`) and the file then reads
    as ended, so FFmpeg stops. PyAV stashes an exception raised in its read callback until its
    next call, and FFmpeg reads again before that: every exception stashed over another is
    printed on stderr with its traceback ("PyAV library exception being dropped"), and one left
    stashed would be raised by the next clip's first call."""

    def __init__(self, fh: Any) -> None:
        super().__init__()
        self.fh = fh
        self.failed: Exception | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self.fh.seekable())

    def tell(self) -> int:
        return int(self.fh.tell())

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        if self.failed is not None:
            return b""
        try:
            return bytes(self.fh.read(size))
        except Exception as exc:  # kept for open_media; FFmpeg sees the end of the file
            self.failed = exc
            return b""

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if self.failed is not None:
            return -1  # FFmpeg's seek fails (EPERM): nothing more is read
        try:
            return int(self.fh.seek(offset, whence))
        except Exception as exc:
            self.failed = exc
            return -1


def pick_stream(container: Any, kind: str) -> Any:
    """The first stream of `kind` ("audio" or "video"); 422 without one, 415 when FFmpeg here has
    no decoder for its codec."""
    streams = [s for s in container.streams if s.type == kind]
    if not streams:
        held = ", ".join(sorted({s.type for s in container.streams})) or "no streams"
        raise decode_error(f"the file has no {kind} stream ({held})", "media.no_stream")
    stream = streams[0]
    if stream.codec_context is None:  # FFmpeg knows no decoder for its codec tag
        raise decode_error(f"the {kind} stream's codec is one FFmpeg here cannot decode ({stream!r})",
                           "media.unsupported_format")
    return stream


def decoded(container: Any, stream: Any) -> Iterator[Any]:
    """The decoded frames of `stream` from where the container is, the decoder flushed at the end."""
    for packet in container.demux(stream):
        yield from packet.decode()


#: FFmpeg errors that mean "not something this FFmpeg decodes" (415) rather than corrupt bytes
_UNSUPPORTED = ("DecoderNotFoundError", "PatchWelcomeError")


def _av_error(exc: BaseException) -> MMError:
    """The one mapping from a PyAV/FFmpeg failure on some bytes to an MMError."""
    import av

    text = trim_message(str(exc) or type(exc).__name__)
    if isinstance(exc, MemoryError):
        return MMError(text, stage="decode", reason="encode.out_of_memory", error=type(exc).__name__)
    unsupported = tuple(getattr(av.error, n) for n in _UNSUPPORTED if hasattr(av.error, n))
    if isinstance(exc, unsupported):
        return decode_error(f"a codec or container FFmpeg here does not decode: {text}", "media.unsupported_format",
                            exc)
    return decode_error(f"corrupt or truncated media: {text}", "media.unreadable", exc)
