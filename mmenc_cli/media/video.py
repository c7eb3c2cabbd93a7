"""Video clips to sampled RGB frames (stage "decode"), with PyAV, by seeking.

Which frames: `frames` spread uniformly over the clip (the frame at the middle of each of
`frames` equal spans), or with `fps` one frame every 1/fps seconds (at most `frames` of them,
spread uniformly when there would be more). Only the first `max_seconds` count; a longer clip is
cut (counted as truncated). A clip whose frames stop well before the duration its container
declares (a partial download) is 400, not its last frame repeated. Each frame comes upright: its
display matrix (the rotation a phone records, a mirror) is applied as FFmpeg's players apply it.

How: for each sampled time the decoder seeks back to the key frame before it and decodes forward
to the first frame at or after that time, unless decoding on from where it is costs no more: the
time is at most `FORWARD_S` ahead, or no key frame lies between the frame in hand and the time (a
seek would land on the key frame already decoded from; the stream's index says where its key
frames are; without one, a gap longer than the stretch decoded since the last key frame), or the
frame in hand is already at or past it (sampling denser than the clip's frame rate takes a frame
again, never an earlier one). A seek that lands after its time (MPEG-TS) is retried further back;
a stream that cannot seek is decoded on. A long clip costs about `frames` key-frame intervals of
decoding, and never much more than one pass over it; a local file is read only there.
A clip whose container does not say its duration is demuxed once (packets, not decoded) to find
it. Each frame's size is checked against `max_pixels` before any frame is decoded.
"""

from __future__ import annotations

import itertools
import math
import struct
from typing import Any, Iterator, NamedTuple

from PIL import Image

from .clips import decode_error, open_media, pick_stream
from .clips import decoded as _decode  # the seam the tests count decoded frames through
from .ranged import HttpClip
from .stores import StoreFile

#: seconds ahead of the decoder's position within which it decodes on rather than seeking
FORWARD_S = 1.0
#: a clip whose frames end more than this (or a tenth of the span) before the last sampled time
#: is truncated (a partial download): 400, not the last frame repeated
TRUNCATED_S = 1.0


def sample_times(duration: float, frames: int, fps: float | None) -> list[float]:
    """Seconds from the clip's start of the frames to take (see the module docstring)."""
    if fps is not None:
        count = max(1, math.floor(duration * fps + 1e-9))
        if count <= frames:
            return [k / fps for k in range(count)]
    return [(k + 0.5) * duration / frames for k in range(frames)]


class Sampled(NamedTuple):
    """A clip's sampled frames, whether it was cut at `max_seconds`, and the seconds between two
    sampled frames (the frame rate a VL model's temporal positions assume)."""

    images: list[Image.Image]
    cut: bool
    step: float


def decode_frames(source: str | bytes | StoreFile | HttpClip, frames: int, fps: float | None, max_seconds: float,
                  max_pixels: int) -> Sampled:
    """The sampled frames as RGB images, whether the clip was longer than `max_seconds`, the step.

    `source` is a local path (read only where the frames are) or the file's bytes. Raises MMError."""
    with open_media(source) as container:
        stream = pick_stream(container, "video")
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > max_pixels:
            raise decode_error(f"video frames are {width}x{height} = {width * height} pixels, over the "
                               f"--max-image-pixels limit of {max_pixels}", "media.too_large")
        start, duration = _span(container, stream)
        span = min(duration, max_seconds)
        times = sample_times(span, frames, fps) if span > 0 else [0.0]
        images, ended = Sampler(container, stream).take([start + t for t in times])
    if not images:
        raise decode_error("the video stream holds no frames", "media.unreadable")
    if ended is not None and start + times[-1] - ended > max(TRUNCATED_S, 0.1 * span):
        raise decode_error(f"the video stream ends at {ended - start:.2f} s, but it says it lasts "
                           f"{duration:.2f} s: truncated or corrupt", "media.unreadable")
    step = times[1] - times[0] if len(times) > 1 else (1 / fps if fps else span)
    return Sampled(images, duration > max_seconds, step)


def _span(container: Any, stream: Any) -> tuple[float, float]:
    """(start time, duration) of the stream in seconds: from its header, else its Matroska
    `DURATION` tag (an end time), else by demuxing its packets once (never the container's
    duration: that is its longest stream's, e.g. a longer audio track's)."""
    base = float(stream.time_base) if stream.time_base is not None else 0.0
    start = stream.start_time * base if stream.start_time is not None else 0.0
    if stream.duration is not None and stream.duration > 0 and base:
        return start, stream.duration * base
    tagged = _clock(stream.metadata.get("DURATION") or stream.metadata.get("duration"))
    if tagged is not None and tagged > 0:
        return start, tagged - start if tagged > start else tagged
    last = None
    for packet in container.demux(stream):
        if packet.pts is not None:
            end = (packet.pts + (packet.duration or 0)) * base
            last = end if last is None else max(last, end)
    if last is None or not _seek(container, stream, 0):
        raise decode_error("the video stream says neither its duration nor its frames' times, or cannot seek "
                           "back after finding them (a raw elementary stream?): remux it into MP4 or WebM",
                           "media.unsupported_format")
    return start, max(0.0, last - start)


def _clock(text: str | None) -> float | None:
    """Seconds of an "HH:MM:SS.fraction" tag (None when absent or malformed)."""
    try:
        h, m, sec = (text or "").split(":")
        return int(h) * 3600 + int(m) * 60 + float(sec)
    except ValueError:
        return None


class Sampler:
    """The frames at given times of one open stream, by seeking (see the module docstring)."""

    def __init__(self, container: Any, stream: Any) -> None:
        self.container, self.stream = container, stream
        self.tolerance = 0.5 / float(stream.average_rate) if stream.average_rate else 0.0
        self.decoded: Iterator[Any] | None = None
        self.frame: Any = None  # the last frame decoded
        self.key: float | None = None  # time of the last key frame decoded
        self.ended: float | None = None  # time of the last frame, once the stream ended before a target

    def take(self, targets: list[float]) -> tuple[list[Image.Image], float | None]:
        """The first frame at or after each (increasing) target time, the last frame for a target
        past the end; and where the stream ended when it ended before a target."""
        out = []
        for target in targets:
            frame = self._at(target)
            if frame is not None:
                out.append(upright(frame))
        return out, self.ended

    def _at(self, target: float) -> Any:
        held = self.frame.time if self.frame is not None and self.frame.time is not None else None
        if held is not None and held >= target - self.tolerance:
            return self.frame  # sampled more densely than the clip's frames: the frame in hand again
        if self.decoded is None or held is None or self._seek_pays(held, target):
            self._seek_before(target)
        for frame in self.decoded:  # type: ignore[union-attr]
            self.frame = frame
            if frame.key_frame and frame.time is not None:
                self.key = frame.time
            if frame.time is None or frame.time >= target - self.tolerance:
                return frame
        self.decoded = iter(())  # the stream ended: later targets take the last frame too
        self.ended = self.frame.time if self.frame is not None else None
        return self.frame

    def _seek_pays(self, held: float, target: float) -> bool:
        """Whether seeking for `target` saves decoding over decoding on from `held`: a seek lands on
        the last key frame at or before `target`, so it pays only when that key frame is past
        `held`. The stream's index (MP4, Matroska cues) says where key frames are when it reaches
        `target`; without it, a gap longer than the stretch decoded since the last key frame is
        taken to hold one (decoding on then costs at most one pass over the clip in all, a seek
        at most twice the gap it skips)."""
        gap = target - held
        if gap <= FORWARD_S:
            return False
        indexed = key_between(self.stream, held, target)
        if indexed is not None:
            return indexed
        return self.key is None or gap > held - self.key

    def _seek_before(self, target: float) -> None:
        """Decode from a key frame at or before `target`: a seek that lands after it (MPEG-TS seeks
        to the next key frame) is retried further back, then from the start; a stream that cannot
        seek at all (a raw H.264 file) is decoded on from where it is."""
        for back in (0.0, 1.0, 5.0, None):
            to = 0.0 if back is None else max(0.0, target - back)
            if not _seek(self.container, self.stream, to):
                self.decoded = self.decoded or _decode(self.container, self.stream)
                return
            self.decoded = _decode(self.container, self.stream)
            first = next(self.decoded, None)  # none: the seek went past the end (MPEG-TS), look further back
            if to == 0.0 or (first is not None and (first.time is None or first.time <= target + self.tolerance)):
                self.decoded = itertools.chain([first] if first is not None else [], self.decoded)
                return


def _seek(container: Any, stream: Any, seconds: float) -> bool:
    """Seek `stream` back to the key frame at or before `seconds`; False when it cannot seek."""
    import av

    try:
        container.seek(max(0, int(seconds / float(stream.time_base))), stream=stream, backward=True,
                       any_frame=False)
    except (av.error.FFmpegError, OSError):  # EPERM for an unseekable stream; other seek failures alike
        return False
    return True


def key_between(stream: Any, after: float, upto: float) -> bool | None:
    """Whether the stream's index lists a key frame after `after` and at or before `upto`
    (seconds); None when it cannot say: no index (MPEG-TS), or one that does not reach `upto`
    yet (Matroska adds to it as it reads), or a PyAV without `index_entries`."""
    entries = getattr(stream, "index_entries", None)
    base = float(stream.time_base) if stream.time_base is not None else 0.0
    if not entries or not base or entries[len(entries) - 1].timestamp < upto / base:
        return None
    lo, hi = 0, len(entries)  # the first entry past `upto`
    while lo < hi:
        mid = (lo + hi) // 2
        if entries[mid].timestamp <= upto / base:
            lo = mid + 1
        else:
            hi = mid
    for i in range(lo - 1, -1, -1):  # back to `after`: within a key-frame interval where they are frequent
        if entries[i].timestamp <= after / base:
            return False
        if entries[i].is_keyframe:
            return True
    return False


def upright(frame: Any) -> Image.Image:
    """The frame as an RGB image as it is shown: its display matrix applied as FFmpeg's players
    apply it (`autorotate`): a right-angle rotation, a mirror, or both; another angle rotates it
    within its own size. A frame without one is returned as decoded."""
    image = frame.to_image()
    matrix = _display_matrix(frame)
    if matrix is None:
        return image
    a, b, c, d = (matrix[i] / 65536 for i in (0, 1, 3, 4))  # 16.16 fixed point
    if not math.hypot(a, c) or not math.hypot(b, d):
        return image
    # FFmpeg's get_rotation() and its players' filters for each angle (clockwise degrees), with the
    # matrix's signs telling a mirrored clip from a rotated one
    theta = float(round(math.degrees(math.atan2(b / math.hypot(b, d), a / math.hypot(a, c)))))
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    flip, mirror = Image.Transpose.FLIP_TOP_BOTTOM, Image.Transpose.FLIP_LEFT_RIGHT
    if abs(theta - 90) < 1:
        steps = [Image.Transpose.TRANSPOSE if c > 0 else Image.Transpose.ROTATE_270]
    elif abs(theta - 180) < 1:
        steps = ([mirror] if a < 0 else []) + ([flip] if d < 0 else [])
    elif abs(theta - 270) < 1:
        steps = [Image.Transpose.TRANSVERSE if c < 0 else Image.Transpose.ROTATE_90]
    elif abs(theta) < 1:
        steps = [flip] if d < 0 else []
    else:
        return image.rotate(-theta, Image.Resampling.BILINEAR)
    for step in steps:
        image = image.transpose(step)
    return image


def _display_matrix(frame: Any) -> tuple[int, ...] | None:
    """The frame's display matrix (FFmpeg's 3x3, row-major, int32), None without one. PyAV up to
    18.1.0 iterates a frame's side data as the entries, later versions as a mapping of their types."""
    container = frame.side_data
    for entry in container:
        keyed = not hasattr(entry, "type")
        if (entry if keyed else entry.type).name == "DISPLAYMATRIX":
            raw = bytes(container[entry] if keyed else entry)
            return struct.unpack("=9i", raw[:36]) if len(raw) >= 36 else None
    return None
