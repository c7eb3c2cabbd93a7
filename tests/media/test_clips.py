"""Audio and video decoding with PyAV (`media/audio.py`, `media/video.py`, `media/clips.py`) on
real files made in the tests: every format, the mono mix, resampling, cuts, frame sampling by
seeking, and what each broken file becomes."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("av")

from mmenc_cli.config import MediaConfig  # noqa: E402
from mmenc_cli.errors import MMError  # noqa: E402
from mmenc_cli.media import load_clip  # noqa: E402
from mmenc_cli.media import video as video_mod  # noqa: E402
from mmenc_cli.media.audio import decode_audio  # noqa: E402
from mmenc_cli.media.video import decode_frames, sample_times  # noqa: E402
from tests import mediafactory as mf  # noqa: E402

PIXELS = MediaConfig().max_image_pixels


def error_of(fn, *args) -> MMError:  # type: ignore[no-untyped-def]
    with pytest.raises(MMError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "m4a"])
def test_every_audio_format_decodes_to_mono_at_the_rate_asked(tmp_path: Path, fmt: str) -> None:
    path = mf.make_audio(tmp_path / f"a.{fmt}", fmt, seconds=1.0, rate=16000)
    samples, cut = decode_audio(str(path), 16000, None)
    assert samples.dtype == np.float32 and samples.ndim == 1 and not cut
    assert 15000 <= len(samples) <= 18000  # lossy codecs add priming and padding
    peak = float(np.abs(samples).max())
    assert 0.4 < peak < 0.65  # the sweep's amplitude 0.5, give or take the codec
    again, _ = decode_audio(path.read_bytes(), 16000, None)  # bytes decode the same as the path
    assert np.array_equal(samples, again)


def test_stereo_is_mixed_to_the_mean_of_its_channels_and_resampled(tmp_path: Path) -> None:
    path = mf.make_audio(tmp_path / "s.wav", "wav", seconds=1.0, rate=16000, channels=2)
    mono, _ = decode_audio(str(path), 16000, None)
    expected = mf.audio_signal(1.0, 16000, channels=2).mean(axis=0)
    assert np.abs(mono - expected).max() < 2e-4  # 16-bit quantization only
    up, _ = decode_audio(str(path), 48000, None)
    assert len(up) == 48000
    # the resampled sweep keeps its level and its shape (compared at the original instants)
    assert np.abs(up[::3] - expected).max() < 0.02


def test_audio_longer_than_the_limit_is_cut_and_says_so(tmp_path: Path) -> None:
    path = mf.make_audio(tmp_path / "long.flac", "flac", seconds=3.0, rate=16000)
    samples, cut = decode_audio(str(path), 16000, 1.0)
    assert cut and len(samples) == 16000
    whole, cut = decode_audio(str(path), 16000, 5.0)
    assert not cut and len(whole) == 48000
    assert np.array_equal(samples, whole[:16000])


@pytest.mark.parametrize("fmt", ["mp4", "webm"])
def test_frames_are_sampled_uniformly_by_seeking(tmp_path: Path, fmt: str) -> None:
    path = mf.make_video(tmp_path / f"v.{fmt}", fmt, seconds=2.0, fps=10)
    images, cut, _ = decode_frames(str(path), 5, None, 3600.0, PIXELS)
    assert not cut and [im.size for im in images] == [(64, 48)] * 5
    got = [mf.nearest_frame(np.asarray(im).reshape(-1, 3).mean(axis=0), 20) for im in images]
    assert got == [2, 6, 10, 14, 18]  # the frames at 0.2, 0.6, 1.0, 1.4 and 1.8 s
    by_rate, _, _ = decode_frames(path.read_bytes(), 64, 2.0, 3600.0, PIXELS)  # --fps 2
    assert [mf.nearest_frame(np.asarray(im).reshape(-1, 3).mean(axis=0), 20) for im in by_rate] == [0, 5, 10, 15]


def test_dense_sampling_never_goes_back_in_time(tmp_path: Path) -> None:
    path = mf.make_video(tmp_path / "v.mp4", "mp4", seconds=2.0, fps=10)
    for frames, fps in ((32, None), (64, 30.0)):  # more frames than the clip has, a rate above its own
        got = [mf.nearest_frame(np.asarray(im).reshape(-1, 3).mean(axis=0), 20)
               for im in decode_frames(str(path), frames, fps, 3600.0, PIXELS)[0]]
        assert got == sorted(got) and got[0] == 0 and got[-1] == 19 and set(got) == set(range(20))


@pytest.mark.parametrize("fmt", ["ts", "webm"])
def test_seeks_that_land_late_and_other_streams_durations_do_not_mislead(tmp_path: Path, fmt: str) -> None:
    # MPEG-TS seeks land on the next key frame (retried further back); a WebM's video stream has
    # no duration of its own, and its audio track runs 6 s longer (so does the container's duration)
    seconds = 10.0 if fmt == "ts" else 2.0
    path = mf.make_video(tmp_path / f"v.{fmt}", fmt, seconds=seconds, fps=10, audio=True, audio_seconds=seconds + 6)
    n = int(seconds * 10)
    images, cut, _ = decode_frames(str(path), 8, None, 3600.0, PIXELS)
    got = [mf.nearest_frame(np.asarray(im).reshape(-1, 3).mean(axis=0), n) for im in images]
    expected = [round((k + 0.5) * n / 8 - 0.5 + 1e-9) for k in range(8)]  # the frame showing mid-span
    assert not cut and all(abs(g - e) <= 1 for g, e in zip(got, expected)), (got, expected)


def test_a_long_clip_is_not_decoded_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = mf.make_video(tmp_path / "long.mp4", "mp4", seconds=30.0, fps=10)  # a key frame every second
    decoded = []
    real = video_mod._decode

    def counting(container, stream):  # type: ignore[no-untyped-def]
        for frame in real(container, stream):
            decoded.append(frame.time)
            yield frame

    monkeypatch.setattr(video_mod, "_decode", counting)
    images, _, _ = decode_frames(str(path), 4, None, 3600.0, PIXELS)
    assert len(images) == 4
    assert len(decoded) <= 4 * 12  # about a key-frame interval per sampled frame, of 300 frames


def test_video_limits_cut_and_refuse(tmp_path: Path) -> None:
    path = mf.make_video(tmp_path / "v.mp4", "mp4", seconds=2.0, fps=10)
    images, cut, _ = decode_frames(str(path), 2, None, 1.0, PIXELS)  # --max-video-seconds 1
    assert cut and [mf.nearest_frame(np.asarray(im).reshape(-1, 3).mean(axis=0), 20) for im in images] == [2, 7]
    err = error_of(decode_frames, str(path), 2, None, 3600.0, 1000)
    assert (err.code, err.reason) == (413, "media.too_large")


def test_sample_times() -> None:
    assert sample_times(2.0, 4, None) == [0.25, 0.75, 1.25, 1.75]
    assert sample_times(2.0, 8, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert sample_times(10.0, 2, 1.0) == [2.5, 7.5]  # more than --frames at that rate: spread uniformly


def test_broken_and_odd_files_become_the_right_errors(tmp_path: Path) -> None:
    clip = mf.make_video(tmp_path / "v.mp4", "mp4")
    audio_only = mf.make_audio_only_mp4(tmp_path / "a.mp4")
    cases = {
        "truncated mp4": (decode_frames, str(mf.truncate(clip, tmp_path / "t.mp4", 0.3)), 400, "media.unreadable"),
        "random bytes": (decode_audio, bytes(range(256)) * 8, 400, "media.unreadable"),
        "unknown codec": (decode_audio, str(mf.make_unknown_codec_wav(tmp_path / "u.wav")), 415,
                          "media.unsupported_format"),
        "no video stream": (decode_frames, str(audio_only), 422, "media.no_stream"),
        "no audio stream": (decode_audio, str(clip), 422, "media.no_stream"),
        "half a webm": (decode_frames, str(mf.truncate(mf.make_video(tmp_path / "w.webm", "webm", seconds=3.0),
                                                       tmp_path / "half.webm", 0.5)), 400, "media.unreadable"),
    }
    for name, (fn, source, code, reason) in cases.items():
        args = (source, 4, None, 3600.0, PIXELS) if fn is decode_frames else (source, 16000, None)
        err = error_of(fn, *args)
        assert (err.code, err.reason, err.stage) == (code, reason, "decode"), name
    wav = mf.make_audio(tmp_path / "w.wav", "wav")
    named_mp4 = mf.wrong_extension(wav, tmp_path / "looks-like.mp4")
    assert len(decode_audio(str(named_mp4), 16000, None)[0]) == 16000  # probed by content, not by name


def test_load_clip_opens_local_files_where_they_lie_and_checks_them(tmp_path: Path) -> None:
    wav = mf.make_audio(tmp_path / "w.wav", "wav")
    media = MediaConfig()
    assert load_clip("w.wav", str(tmp_path), media) == str(tmp_path / "w.wav")
    assert load_clip(wav.as_uri(), "", media) == str(wav)
    assert load_clip(wav.read_bytes(), "", media) == wav.read_bytes()
    (tmp_path / "empty.wav").write_bytes(b"")
    err = error_of(load_clip, "empty.wav", str(tmp_path), media)
    assert (err.code, err.reason, err.stage) == (400, "media.empty", "load")
    err = error_of(load_clip, "w.wav", str(tmp_path), MediaConfig(max_audio_bytes=100).limit_bytes("audio"))
    assert (err.code, err.reason) == (413, "media.file_too_large") and "--max-audio-bytes" in err.message
    same = MediaConfig(max_file_bytes=100, max_audio_bytes=100, max_video_bytes=100)  # limits alike: named still
    for medium in ("audio", "video"):
        err = error_of(load_clip, "w.wav", str(tmp_path), same.limit_bytes(medium))
        assert f"--max-{medium}-bytes (" in err.message, err.message
    err = error_of(load_clip, "missing.wav", str(tmp_path), media)
    assert (err.code, err.reason) == (404, "media.not_found")


def test_a_clip_in_an_object_store_is_read_only_where_its_frames_are(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    from mmenc_cli.media.stores import StoreFile

    path = mf.make_video(tmp_path / "long.mp4", "mp4", seconds=30.0, fps=10, size=(160, 120), grain=30)
    fsspec.filesystem("memory").pipe("/clips/long.mp4", path.read_bytes())
    read: list[int] = []
    real = StoreFile.open

    def counting(self: StoreFile):  # type: ignore[no-untyped-def]
        fh = real(self)
        whole = fh.read

        def part(n: int = -1) -> bytes:
            data = whole(n)
            read.append(len(data))
            return data

        fh.read = part
        return fh

    monkeypatch.setattr(StoreFile, "open", counting)
    clip = load_clip("memory://clips/long.mp4", "", MediaConfig())
    assert isinstance(clip, StoreFile)
    images, _, _ = decode_frames(clip, 4, None, 3600.0, PIXELS)
    local, _, _ = decode_frames(str(path), 4, None, 3600.0, PIXELS)
    assert [np.asarray(a).tolist() for a in images] == [np.asarray(b).tolist() for b in local]
    assert 0 < sum(read) < path.stat().st_size / 2  # the sampled frames' ranges, not the whole clip
    err = error_of(load_clip, "memory://clips/missing.mp4", "", MediaConfig())
    assert (err.code, err.reason, err.stage) == (404, "media.not_found", "load")
    err = error_of(load_clip, "long.mp4", "memory://clips", MediaConfig(max_video_bytes=100).limit_bytes("video"))
    assert (err.code, err.reason) == (413, "media.file_too_large")


class _Ranges(BaseHTTPRequestHandler):
    """Serves `server.files` by path, with Range requests unless `server.ranges` is False."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        data = self.server.files.get(self.path)  # type: ignore[attr-defined]
        if data is None:
            self.send_error(404)
            return
        asked = self.headers.get("Range")
        self.server.requests += 1  # type: ignore[attr-defined]
        if asked and self.server.ranges:  # type: ignore[attr-defined]
            first, last = (int(x) for x in asked.removeprefix("bytes=").split("-"))
            if first >= self.server.fail_from:  # type: ignore[attr-defined]
                self.send_error(500)
                return
            body = data[first:min(last + 1, first + self.server.cap)]  # type: ignore[attr-defined]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{first + len(body) - 1}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.server.sent += len(body)  # type: ignore[attr-defined]

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def ranged_server() -> Any:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ranges)
    server.files, server.ranges, server.sent, server.requests = {}, True, 0, 0  # type: ignore[attr-defined]
    server.cap, server.fail_from = 1 << 40, 1 << 40  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_clip_behind_a_url_is_fetched_in_ranges(tmp_path: Path, ranged_server: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from mmenc_cli.media import ranged

    monkeypatch.setattr(ranged, "BLOCK", 1 << 16)  # a 4.7 MB clip in 64 KiB blocks (1 MiB for real ones)
    path = mf.make_video(tmp_path / "long.mp4", "mp4", seconds=60.0, fps=10, size=(160, 120), grain=30)
    ranged_server.files["/long.mp4"] = path.read_bytes()
    url = f"http://127.0.0.1:{ranged_server.server_port}/long.mp4"
    media = MediaConfig(fetch_retries=0)
    clip = load_clip(url, "", media)
    assert isinstance(clip, ranged.HttpClip)
    local, _, _ = decode_frames(str(path), 4, None, 3600.0, PIXELS)
    images, _, _ = decode_frames(clip, 4, None, 3600.0, PIXELS)
    assert [np.asarray(a).tolist() for a in images] == [np.asarray(b).tolist() for b in local]
    size = path.stat().st_size
    assert 0 < ranged_server.sent < size / 2  # the blocks around 4 frames and the index

    ranged_server.cap = 4096  # ranges answered short: each block completed by further requests
    images, _, _ = decode_frames(load_clip(url, "", media), 4, None, 3600.0, PIXELS)
    assert [np.asarray(a).tolist() for a in images] == [np.asarray(b).tolist() for b in local]
    ranged_server.cap = 1 << 40

    ranged_server.ranges, ranged_server.sent = False, 0  # a server without ranges: its one whole answer
    images, _, _ = decode_frames(load_clip(url, "", media), 4, None, 3600.0, PIXELS)
    assert [np.asarray(a).tolist() for a in images] == [np.asarray(b).tolist() for b in local]
    assert ranged_server.sent == size

    ranged_server.ranges, ranged_server.fail_from, ranged_server.requests = True, 1 << 16, 0  # block 1 fails
    err = error_of(decode_frames, load_clip(url, "", MediaConfig(fetch_retries=1)), 4, None, 3600.0, PIXELS)
    assert (err.code, err.reason, err.stage) == (503, "remote.unavailable", "load")
    assert ranged_server.requests == 1 + 2  # block 0, then block 1 tried twice: the failure sticks
    ranged_server.fail_from = 1 << 40
    err = error_of(decode_frames, load_clip(url.replace("long", "gone"), "", media), 4, None, 3600.0, PIXELS)
    assert (err.code, err.reason, err.stage) == (404, "remote.not_found", "load")
    ranged_server.ranges = True
    small = MediaConfig(fetch_retries=0, max_video_bytes=size - 1).limit_bytes("video")
    err = error_of(decode_frames, load_clip(url, "", small), 4, None, 3600.0, PIXELS)
    assert (err.code, err.reason) == (413, "media.file_too_large")


def test_a_clip_that_vanishes_or_cannot_be_read_is_that_not_corrupt_media(tmp_path: Path) -> None:
    """After its checks: a local file deleted is 404 (PyAV's error is an OSError too); a store's
    read failing with not found / permission denied is 404 / 403, other OSErrors 503."""
    from mmenc_cli.media.stores import StoreFile

    err = error_of(decode_audio, str(tmp_path / "gone.wav"), 16000, None)
    assert (err.code, err.reason, err.stage) == (404, "media.not_found", "load")

    class Failing:
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def open(self, path: str, mode: str) -> Any:
            raise self.exc

    for exc, code in [(FileNotFoundError("gone"), 404), (PermissionError("no"), 403), (OSError("reset"), 503),
                      (RuntimeError("client"), 503)]:
        err = error_of(decode_audio, StoreFile(Failing(exc), "x.wav", "s3://b/x.wav"), 16000, None)
        assert (err.code, err.stage) == (code, "load"), (exc, err)
    wav = mf.make_audio(tmp_path / "w.wav", "wav")
    wav.write_bytes(b"\0" * wav.stat().st_size)  # there and readable, but not media: still the media's fault
    assert error_of(decode_audio, str(wav), 16000, None).code == 400
