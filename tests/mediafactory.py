"""Tiny, deterministic audio and video files made with PyAV, for the media tests.

Every `make_*` function writes one file at `path` (the caller picks the name; the container is
chosen by `fmt`, never by the suffix) and returns `path`. The files are a few KB to a few tens of
KB and each takes well under half a second to make. Same arguments, same bytes: the signals are
computed (a sine sweep, or noise from a seeded generator) and the encoders run single-threaded.

What the files hold, so a test can check what a reader gave back:

* audio (`make_audio`): a sine sweep from `SWEEP_HZ[0]` to `SWEEP_HZ[1]` or seeded uniform noise,
  peak amplitude `AMPLITUDE` in the left (or only) channel; in stereo the right channel is the
  same signal at half that, so the mean of the two channels is 0.75 x the left one.
* video (`make_video`): frame `k` is a flat background of colour `frame_color(k)` with a white
  `size[1] // 3` square that moves from the left edge to the right edge over the clip; the square's
  area is the same in every frame, so the mean colour of frame `k` is `expected_mean_rgb(k, size)`
  (give or take a few levels of yuv420p/codec loss) and `nearest_frame` says which frame a decoded
  mean colour came from. Frame `k` has presentation time `k / fps` seconds.
* broken files: `truncate` (first part of a file's bytes), `wrong_extension` (same bytes, a
  misleading name) and `make_unknown_codec_wav` (a valid RIFF/WAVE file whose codec FFmpeg cannot
  decode).
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

AMPLITUDE = 0.5
SWEEP_HZ = (220.0, 2000.0)
TONE_HZ = 440.0  # the sine in a video's audio track
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # the only rates libopus takes

# fmt -> (container format, encoder)
_AUDIO = {
    "wav": ("wav", "pcm_s16le"),
    "flac": ("flac", "flac"),
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "m4a": ("mp4", "aac"),
    "aac": ("adts", "aac"),
}
# no random Ogg serial numbers, no encoder version strings: same arguments, same bytes
_BITEXACT = {"fflags": "+bitexact"}
_VIDEO = {"mp4": ("mp4", "libx264"), "webm": ("webm", "libvpx-vp9"), "ts": ("mpegts", "libx264")}


def audio_signal(
    seconds: float = 1.0, rate: int = 16000, channels: int = 1, kind: str = "sweep", seed: int = 0
) -> np.ndarray:
    """The float32 samples `make_audio` encodes, shape (channels, n): channel 1 is channel 0 halved."""
    n = int(round(seconds * rate))
    if kind == "sweep":
        t = np.arange(n) / rate
        f0, f1 = SWEEP_HZ
        # linear sweep: phase is the integral of f0 + (f1 - f0) t / T
        phase = 2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * max(seconds, 1e-9)))
        x = AMPLITUDE * np.sin(phase)
    elif kind == "noise":
        x = np.random.default_rng(seed).uniform(-AMPLITUDE, AMPLITUDE, n)
    else:
        raise ValueError(f"kind must be 'sweep' or 'noise', not {kind!r}")
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2, not {channels}")
    rows = [x] if channels == 1 else [x, 0.5 * x]
    return np.asarray(rows, dtype=np.float32)


def _encode_audio(container: Any, stream: Any, samples: np.ndarray, rate: int) -> None:
    """Encode `samples` (float32, channels x n, at `rate`) into `stream`, converting format, rate and framing."""
    import av

    cc = stream.codec_context
    if not cc.is_open:  # (muxing a first packet opens every stream)
        cc.open()  # sets frame_size (0 for codecs that take any size)
    layout = "mono" if samples.shape[0] == 1 else "stereo"
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
    frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
    resampler = av.AudioResampler(
        format=cc.format, layout=cc.layout, rate=cc.sample_rate, frame_size=cc.frame_size or 1024
    )
    for f in [*resampler.resample(frame), *resampler.resample(None)]:
        container.mux(stream.encode(f))
    container.mux(stream.encode(None))


def make_audio(
    path: str | Path,
    fmt: str,
    seconds: float = 1.0,
    rate: int = 16000,
    channels: int = 1,
    kind: str = "sweep",
    seed: int = 0,
) -> Path:
    """Write `audio_signal(...)` as `fmt`: "wav" (pcm_s16le), "flac", "mp3" (libmp3lame), "opus"
    (libopus in Ogg), "m4a" (aac in MP4: an audio-only .mp4) or "aac" (raw ADTS).

    The file's rate is `rate`, except for "opus" when `rate` is not one of `OPUS_RATES`: then the
    signal is resampled to 48000 Hz. Whatever the encoded rate, FFmpeg decodes Opus at 48000 Hz.
    Lossy formats do not give the samples back exactly: peaks within ~15% for the sweep, AAC adds
    priming/padding (16000 samples in -> 16384 out of "m4a", 17408 out of "aac"). FFmpeg reports a
    WAV's channel layout as "1 channels" / "2 channels" (no channel mask), the others as mono/stereo.
    """
    import av

    if fmt not in _AUDIO:
        raise ValueError(f"fmt must be one of {sorted(_AUDIO)}, not {fmt!r}")
    path = Path(path)
    container_fmt, codec = _AUDIO[fmt]
    out_rate = rate if (codec != "libopus" or rate in OPUS_RATES) else 48000
    samples = audio_signal(seconds, rate, channels, kind, seed)
    with av.open(str(path), "w", format=container_fmt, container_options=_BITEXACT) as container:
        stream = container.add_stream(codec, rate=out_rate, layout="mono" if channels == 1 else "stereo")
        stream.codec_context.thread_count = 1
        if codec in ("libmp3lame", "aac", "libopus"):
            stream.codec_context.bit_rate = 32000 * channels
        if codec == "aac":  # the default "twoloop" coder overshoots to ~2x the peak at 32 kbit/s
            stream.codec_context.options = {"aac_coder": "fast"}
        _encode_audio(container, stream, samples, rate)
    return path


def make_audio_only_mp4(path: str | Path, seconds: float = 1.0, rate: int = 16000) -> Path:
    """An MP4 with one AAC audio stream and no video stream (for "no video stream" errors)."""
    return make_audio(path, "m4a", seconds=seconds, rate=rate)


def frame_color(index: int) -> tuple[int, int, int]:
    """Background RGB of video frame `index` (shown at `index / fps` s): red steps by 12 a frame,
    green by 12 every 20 frames, blue is fixed; unique for the first 400 frames."""
    return (16 + 12 * (index % 20), 16 + 12 * ((index // 20) % 20), 96)


def _square(size: tuple[int, int]) -> int:
    return max(2, size[1] // 3)


def expected_mean_rgb(index: int, size: tuple[int, int] = (64, 48)) -> tuple[float, float, float]:
    """Mean RGB of frame `index` as drawn (background plus the white square), before encoding."""
    w, h = size
    a = _square(size) ** 2 / (w * h)
    return tuple(c * (1 - a) + 255 * a for c in frame_color(index))  # type: ignore[return-value]


def nearest_frame(mean_rgb: Sequence[float] | np.ndarray, n_frames: int, size: tuple[int, int] = (64, 48)) -> int:
    """Index of the frame (of `n_frames`) whose `expected_mean_rgb` is closest to `mean_rgb`."""
    m = np.asarray(mean_rgb, dtype=np.float64)[:3]
    d = [float(np.abs(np.asarray(expected_mean_rgb(k, size)) - m).sum()) for k in range(n_frames)]
    return int(np.argmin(d))


def video_frame_rgb(index: int, n_frames: int, size: tuple[int, int] = (64, 48)) -> np.ndarray:
    """Frame `index` of an `n_frames` clip as drawn: uint8 array (h, w, 3)."""
    w, h = size
    s = _square(size)
    img = np.empty((h, w, 3), dtype=np.uint8)
    img[:] = frame_color(index)
    x = round((w - s) * index / max(n_frames - 1, 1))
    y = (h - s) // 2
    img[y : y + s, x : x + s] = 255
    return img


def make_video(
    path: str | Path,
    fmt: str,
    seconds: float = 2.0,
    fps: int = 10,
    size: tuple[int, int] = (64, 48),
    audio: bool = False,
    seed: int = 0,
    faststart: bool = False,
    audio_seconds: float | None = None,
    grain: int = 0,
) -> Path:
    """Write `round(seconds * fps)` frames of `video_frame_rgb` as "mp4" (libx264 yuv420p, a keyframe
    every second, B-frames on) or "webm" (libvpx-vp9, libvpx if VP9 is missing; a keyframe every
    second) or "ts" (libx264 in MPEG-TS, whose seeks land on the next key frame). With `audio`, a
    mono `TONE_HZ` sine of the same length (or `audio_seconds`) is muxed in: AAC 16 kHz in mp4 and
    ts, Opus 48 kHz in webm. `grain`: seeded zero-mean noise of that amplitude on every frame (files
    that do not compress to almost nothing; mean colours stay within a level or two). `faststart`
    (mp4 only) puts the moov atom before the media data.
    `seed` is accepted for symmetry with `make_audio`; the frames do not depend on it.
    """
    import av

    if fmt not in _VIDEO:
        raise ValueError(f"fmt must be one of {sorted(_VIDEO)}, not {fmt!r}")
    path = Path(path)
    container_fmt, codec = _VIDEO[fmt]
    if codec == "libvpx-vp9" and "libvpx-vp9" not in av.codecs_available:
        codec = "libvpx"
    n = max(1, int(round(seconds * fps)))
    options = {**_BITEXACT, "movflags": "faststart"} if (faststart and fmt == "mp4") else _BITEXACT
    with av.open(str(path), "w", format=container_fmt, container_options=options) as container:
        vs = container.add_stream(codec, rate=fps)
        cc = vs.codec_context
        cc.width, cc.height, cc.pix_fmt = size[0], size[1], "yuv420p"
        cc.gop_size = fps
        cc.thread_count = 1
        if codec == "libx264":
            cc.options = {"preset": "veryfast", "crf": "18", "threads": "1"}
        else:
            cc.bit_rate = 0
            cc.options = {"deadline": "realtime", "cpu-used": "8", "crf": "12", "lag-in-frames": "0", "threads": "1"}
        astream = None
        if audio:
            acodec, arate = ("libopus", 48000) if fmt == "webm" else ("aac", 16000)
            astream = container.add_stream(acodec, rate=arate, layout="mono")
            astream.codec_context.bit_rate = 24000
            if acodec == "aac":
                astream.codec_context.options = {"aac_coder": "fast"}
            astream.codec_context.thread_count = 1
        for i in range(n):
            rgb = video_frame_rgb(i, n, size)
            if grain:
                noise = np.random.default_rng(seed * 100003 + i).integers(-grain, grain + 1, rgb.shape)
                rgb = np.clip(rgb.astype(np.int16) + noise, 0, 255).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
            frame.pts = i
            container.mux(vs.encode(frame))
        container.mux(vs.encode(None))
        if astream is not None:
            t = np.arange(int(round((audio_seconds or n / fps) * arate))) / arate
            tone = (AMPLITUDE * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)[None, :]
            _encode_audio(container, astream, tone, arate)
    return path


def truncate(path: str | Path, out: str | Path, keep_fraction: float = 0.3) -> Path:
    """Write the first `keep_fraction` of `path`'s bytes to `out`."""
    data = Path(path).read_bytes()
    out = Path(out)
    out.write_bytes(data[: int(len(data) * keep_fraction)])
    return out


def wrong_extension(path: str | Path, out: str | Path) -> Path:
    """Copy `path`'s bytes to `out`, whose suffix is meant to lie (e.g. a WAV named clip.mp4)."""
    out = Path(out)
    shutil.copyfile(path, out)
    return out


def make_unknown_codec_wav(
    path: str | Path, tag: int = 0x1234, seconds: float = 0.5, rate: int = 8000, seed: int = 0
) -> Path:
    """A well-formed RIFF/WAVE file (mono, 8 bits a sample, seeded random payload) whose fmt chunk
    has format tag `tag`. The default 0x1234 is a tag FFmpeg maps to no codec at all: `av.open`
    succeeds and finds one audio stream whose `codec_context` is None, and decoding it raises
    `av.error.DecoderNotFoundError`. (Real tags FFmpeg knows, e.g. 0x0161 WMAv2, instead give a
    codec that fails on the random payload with `InvalidDataError`: that is "corrupt", not this.)"""
    data = np.random.default_rng(seed).integers(0, 256, int(seconds * rate), dtype=np.uint8).tobytes()
    fmt = struct.pack("<HHIIHH", tag, 1, rate, rate, 1, 8)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path = Path(path)
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return path
