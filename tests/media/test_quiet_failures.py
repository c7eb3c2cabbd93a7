"""A clip whose reads fail part-way (a URL read in ranges, an object-store file) is one error for
its item and nothing on stderr: PyAV prints every exception its read callback stashes over another
("PyAV library exception being dropped" and a traceback), and one left stashed would fail the
next clip decoded in the same worker."""

from __future__ import annotations

import errno
import io
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("av")

from mmenc_cli.config import MediaConfig  # noqa: E402
from mmenc_cli.errors import MMError  # noqa: E402
from mmenc_cli.media import load_clip  # noqa: E402
from mmenc_cli.media.audio import decode_audio  # noqa: E402
from mmenc_cli.media.stores import StoreFile  # noqa: E402
from mmenc_cli.media.video import decode_frames  # noqa: E402
from tests import mediafactory as mf  # noqa: E402
from tests.media.test_clips import ranged_server  # noqa: E402, F401 - the fixture

PIXELS = MediaConfig().max_image_pixels
NOISE = ("Traceback", "dropped", "Exception ignored")


def error_of(fn, *args) -> MMError:  # type: ignore[no-untyped-def]
    with pytest.raises(MMError) as info:
        fn(*args)
    return info.value


def assert_quiet(capfd: pytest.CaptureFixture[str]) -> None:
    err = capfd.readouterr().err
    assert not any(n in err for n in NOISE), err


class Breaking(io.BytesIO):
    """A store's file whose reads fail past `limit` bytes (a connection reset mid-file)."""

    def __init__(self, data: bytes, limit: int) -> None:
        super().__init__(data)
        self.limit = limit

    def read(self, size: int = -1) -> bytes:  # type: ignore[override]
        if self.tell() + max(size, 0) > self.limit:
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return super().read(size)


class BreakingStore:
    def __init__(self, data: bytes, limit: int) -> None:
        self.data, self.limit = data, limit

    def open(self, path: str, mode: str) -> Any:
        return Breaking(self.data, self.limit)


def test_a_clip_whose_ranges_fail_is_its_error_and_nothing_on_stderr(tmp_path: Path, ranged_server: Any,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    from mmenc_cli.media import ranged

    monkeypatch.setattr(ranged, "BLOCK", 1 << 16)
    path = mf.make_video(tmp_path / "v.mp4", "mp4", seconds=10.0, fps=10, size=(160, 120), grain=30)
    assert path.stat().st_size > 4 * (1 << 16)
    ranged_server.files["/v.mp4"] = path.read_bytes()
    ranged_server.fail_from = 1 << 16  # block 0 comes, every later block is a 500
    url = f"http://127.0.0.1:{ranged_server.server_port}/v.mp4"
    capfd.readouterr()
    err = error_of(decode_frames, load_clip(url, "", MediaConfig(fetch_retries=0)), 4, None, 3600.0, PIXELS)
    assert (err.code, err.reason, err.stage) == (503, "remote.unavailable", "load"), err
    assert_quiet(capfd)
    # nothing left behind for the next clip decoded in this process
    assert len(decode_frames(path.read_bytes(), 4, None, 3600.0, PIXELS).images) == 4
    assert_quiet(capfd)


@pytest.mark.parametrize("medium", ["video", "audio"])
def test_a_store_file_whose_reads_fail_is_its_error_and_nothing_on_stderr(tmp_path: Path, medium: str,
                                                                         capfd: pytest.CaptureFixture[str]) -> None:
    if medium == "video":
        path = mf.make_video(tmp_path / "v.mp4", "mp4", seconds=10.0, fps=10, size=(160, 120), grain=30)
    else:
        path = mf.make_audio(tmp_path / "a.wav", "wav", seconds=10.0)
    data = path.read_bytes()
    clip = StoreFile(BreakingStore(data, len(data) // 3), "x", f"s3://bucket/{path.name}")
    capfd.readouterr()
    if medium == "video":
        err = error_of(decode_frames, clip, 8, None, 3600.0, PIXELS)
    else:
        err = error_of(decode_audio, clip, 16000, None)
    assert (err.code, err.stage) == (503, "load") and "reset" in err.message, err
    assert_quiet(capfd)
