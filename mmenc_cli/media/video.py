"""Video clips to sampled RGB frames (stage "decode"), with PyAV, by seeking.

Which frames: `frames` spread uniformly over the clip (the frame at the middle of each of
`frames` equal spans), or with `fps` one frame every 1/fps seconds (at most `frames` of them,
spread uniformly when there would be more). Only the first `max_seconds` count; a longer clip is
cut (counted as truncated). A clip whose frames stop well before the duration its container
declares (a partial download) is 400, not its last frame repeated.

How: for each sampled time the decoder seeks back to the key frame before it and decodes forward
to the first frame at or after that time, unless the time is at most `FORWARD_S` ahead of where
decoding already is (decoding on is then cheaper than seeking). A long clip costs about
`frames` key-frame intervals of decoding, not its whole length; a local file is read only there.
A clip whose container does not say its duration is demuxed once (packets, not decoded) to find
it. Each frame's size is checked against `max_pixels` before any frame is decoded.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from PIL import Image

from .clips import decode_error, open_media, pick_stream

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


def decode_frames(source: str | bytes, frames: int, fps: float | None, max_seconds: float,
                  max_pixels: int) -> tuple[list[Image.Image], bool]:
    """(the sampled frames as RGB images, whether the clip was longer than `max_seconds`).

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
        images, last = _frames_at(container, stream, [start + t for t in times])
    if not images:
        raise decode_error("the video stream holds no frames", "media.unreadable")
    if last is not None and start + times[-1] - last > max(TRUNCATED_S, 0.1 * span):
        raise decode_error(f"the video stream ends at {last - start:.2f} s, but the clip says it lasts "
                           f"{duration:.2f} s: truncated or corrupt", "media.unreadable")
    return images, duration > max_seconds


def _span(container: Any, stream: Any) -> tuple[float, float]:
    """(start time, duration) of the stream in seconds: from its header, else the container's,
    else by demuxing its packets once."""
    base = float(stream.time_base) if stream.time_base is not None else 0.0
    start = stream.start_time * base if stream.start_time is not None else 0.0
    if stream.duration is not None and stream.duration > 0 and base:
        return start, stream.duration * base
    if container.duration is not None and container.duration > 0:
        return start, container.duration / 1_000_000
    last = None
    for packet in container.demux(stream):
        if packet.pts is not None:
            end = (packet.pts + (packet.duration or 0)) * base
            last = end if last is None else max(last, end)
    container.seek(0)
    return start, max(0.0, (last or 0.0) - start)


def _frames_at(container: Any, stream: Any, targets: list[float]) -> tuple[list[Image.Image], float | None]:
    """The first frame at or after each target time (the last frame for a target past the end),
    and the time of the last frame decoded when the stream ended before a target (else None)."""
    base = float(stream.time_base)
    tolerance = 0.5 / float(stream.average_rate) if stream.average_rate else 0.0
    out: list[Image.Image] = []
    decoded: Iterator[Any] | None = None
    position = -math.inf  # time of the last frame decoded
    last, ended = None, None
    for target in targets:
        if decoded is None or target > position + FORWARD_S or target < position - tolerance:
            container.seek(max(0, int(target / base)), stream=stream, backward=True, any_frame=False)
            decoded = _decode(container, stream)
        frame = None
        for frame in decoded:
            position = frame.time if frame.time is not None else position
            last = frame
            if frame.time is None or frame.time >= target - tolerance:
                break
        else:
            decoded = iter(())  # the stream ended: later targets take the last frame too
            frame = last
            ended = position
        if frame is not None:
            out.append(frame.to_image())
    return out, ended


def _decode(container: Any, stream: Any) -> Iterator[Any]:
    for packet in container.demux(stream):
        yield from packet.decode()
