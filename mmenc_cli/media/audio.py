"""Audio clips to mono float32 samples at the model's rate (stage "decode"), with PyAV.

The first audio stream is decoded, resampled to `rate` by FFmpeg (its layout kept), and mixed
down to mono as the mean of its channels (the convention of librosa and of the reference
pipelines; FFmpeg's own stereo-to-mono mix is 3 dB quieter). Decoding stops once `seconds` of
audio are in hand: a two-hour recording costs what its first seconds cost, and is reported as
cut (counted as truncated).
"""

from __future__ import annotations

import numpy as np

from .clips import decode_error, decoded, open_media, pick_stream


def decode_audio(source: str | bytes, rate: int, seconds: float | None) -> tuple[np.ndarray, bool]:
    """(mono float32 samples at `rate`, whether the clip was longer than `seconds` and cut).

    `source` is a local path (read as far as needed) or the file's bytes. Raises MMError."""
    import av

    need = None if seconds is None else max(1, int(round(seconds * rate)))
    parts: list[np.ndarray] = []
    total, cut = 0, False
    with open_media(source) as container:
        stream = pick_stream(container, "audio")
        resampler = av.AudioResampler(format="fltp", rate=rate)
        for frame in decoded(container, stream):
            for out in resampler.resample(frame):
                total += _keep(parts, out)
            if need is not None and total > need:
                cut = True
                break
        else:
            for out in resampler.resample(None):  # what the resampler still holds
                total += _keep(parts, out)
    if total == 0:
        raise decode_error("the audio stream holds no samples", "media.unreadable")
    samples = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if need is not None and len(samples) > need:
        samples, cut = samples[:need], True
    return np.ascontiguousarray(samples, dtype=np.float32), cut


def _keep(parts: list[np.ndarray], frame) -> int:  # type: ignore[no-untyped-def]
    """Append one resampled frame as mono samples; return how many."""
    planes = frame.to_ndarray()  # [channels, samples], float32 planar
    mono = planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)
    parts.append(mono)
    return int(mono.shape[0])
