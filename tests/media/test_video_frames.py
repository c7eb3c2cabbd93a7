"""Video frames as they are shown and what sampling them costs (`media/video.py`), on clips made
here with PyAV: a display matrix (a phone's rotation, a mirror) turns the frames upright, and a
clip with few key frames is decoded about once, not once per sampled frame."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

av = pytest.importorskip("av")

from mmenc_cli.config import MediaConfig  # noqa: E402
from mmenc_cli.media import video as video_mod  # noqa: E402
from mmenc_cli.media.video import decode_frames  # noqa: E402
from tests import mediafactory as mf  # noqa: E402

PIXELS = MediaConfig().max_image_pixels
_FORMATS = {"mp4": ("mp4", "libx264"), "ts": ("mpegts", "libx264"), "webm": ("webm", "libvpx-vp9")}


def write_clip(path: Path, fmt: str, images: list[np.ndarray], fps: int = 10, gop: int = 10,
               rotation: tuple[int, bool, bool] | None = None) -> Path:
    """`images` (RGB, h x w x 3) as a clip with a key frame every `gop` frames (no scene-cut key
    frames) and, with `rotation` = (counter-clockwise degrees, hflip, vflip), a display matrix."""
    container_fmt, codec = _FORMATS[fmt]
    if codec == "libvpx-vp9" and codec not in av.codecs_available:
        codec = "libvpx"
    h, w = images[0].shape[:2]
    with av.open(str(path), "w", format=container_fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        cc = stream.codec_context
        cc.width, cc.height, cc.pix_fmt, cc.gop_size, cc.thread_count = w, h, "yuv420p", gop, 1
        if codec == "libx264":
            cc.options = {"preset": "veryfast", "crf": "12", "threads": "1", "x264-params": "scenecut=0"}
        else:
            cc.bit_rate = 0
            cc.options = {"deadline": "realtime", "cpu-used": "8", "crf": "12", "lag-in-frames": "0", "threads": "1"}
        if rotation is not None:
            stream.set_display_rotation(rotation[0], hflip=rotation[1], vflip=rotation[2])
        for i, rgb in enumerate(images):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def marked(w: int = 64, h: int = 48) -> np.ndarray:
    """A frame that shows which way it is turned: blue, a red block top left, a green one top right."""
    img = np.zeros((h, w, 3), np.uint8)
    img[:] = (0, 0, 200)
    img[: h // 3, : w // 4] = (250, 0, 0)
    img[: h // 3, -(w // 4):] = (0, 250, 0)
    return img


@pytest.mark.parametrize("rotation", [
    (-90, False, False),  # a phone held upright: stored landscape, shown turned 90 degrees clockwise
    (90, False, False),
    (180, False, False),
    (0, True, False),  # a mirrored front camera
    (90, False, True),
    (-90, True, False),
])
def test_a_clip_with_a_display_matrix_comes_out_as_it_is_shown(tmp_path: Path,
                                                              rotation: tuple[int, bool, bool]) -> None:
    stored = marked()
    path = write_clip(tmp_path / "r.mp4", "mp4", [stored] * 5, rotation=rotation)
    degrees, hflip, vflip = rotation
    shown = np.rot90(stored, k=degrees // 90)  # counter-clockwise, as PyAV writes it; then the mirrors
    shown = shown[:, ::-1] if hflip else shown
    shown = shown[::-1] if vflip else shown
    for source in (str(path), path.read_bytes()):
        images, _, _ = decode_frames(source, 2, None, 3600.0, PIXELS)
        for image in images:
            got = np.asarray(image).astype(int)
            assert got.shape == shown.shape
            assert np.abs(got - shown).mean() < 8  # codec loss only, not a turned picture


def test_a_clip_without_a_display_matrix_is_as_decoded(tmp_path: Path) -> None:
    path = write_clip(tmp_path / "plain.mp4", "mp4", [marked()] * 3)
    image = decode_frames(str(path), 1, None, 3600.0, PIXELS).images[0]
    assert image.size == (64, 48) and np.abs(np.asarray(image).astype(int) - marked()).mean() < 8


def counted(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every frame the sampler decodes, through the module's seam."""
    decoded: list[Any] = []
    real = video_mod._decode

    def counting(container: Any, stream: Any) -> Any:
        for frame in real(container, stream):
            decoded.append(frame.time)
            yield frame

    monkeypatch.setattr(video_mod, "_decode", counting)
    return decoded


@pytest.mark.parametrize("fmt", ["mp4", "ts", "webm"])  # an index of key frames, none, Matroska cues
def test_a_clip_with_one_key_frame_is_decoded_about_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         fmt: str) -> None:
    n = 400  # frame_color tells the first 400 frames apart
    path = write_clip(tmp_path / f"one.{fmt}", fmt, [mf.video_frame_rgb(k, n) for k in range(n)], fps=20,
                      gop=10 * n)
    with av.open(str(path)) as container:
        assert sum(p.is_keyframe for p in container.demux(video=0)) == 1
    decoded = counted(monkeypatch)
    for frames in (8, 32):
        decoded.clear()
        images, _, _ = decode_frames(str(path), frames, None, 3600.0, PIXELS)
        got = [mf.nearest_frame(np.asarray(im).reshape(-1, 3).mean(axis=0), n) for im in images]
        expected = [round((k + 0.5) * n / frames - 0.5 + 1e-9) for k in range(frames)]  # the frame showing mid-span
        assert all(abs(g - e) <= 1 for g, e in zip(got, expected)), (got, expected)
        assert len(decoded) <= 1.25 * n, (frames, len(decoded))  # was frames x half the clip: 1,600 and 6,400


def test_frequent_key_frames_are_still_sought(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 300  # 30 s, a key frame every second
    path = write_clip(tmp_path / "often.mp4", "mp4", [mf.video_frame_rgb(k % 400, n) for k in range(n)], gop=10)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        # the index holds decoding times: the key frame shown at 2.0 s is decoded 2 frames earlier
        assert video_mod.key_between(stream, 0.2, 1.5) is True and video_mod.key_between(stream, 1.2, 1.7) is False
        assert video_mod.key_between(stream, 0.0, 3600.0) is None  # past its last frame: the index cannot say
    decoded = counted(monkeypatch)
    assert len(decode_frames(str(path), 4, None, 3600.0, PIXELS).images) == 4
    assert len(decoded) <= 4 * 12  # a key-frame interval per sampled frame, of 300 frames
