"""Video frame sampling by seeking, against decoding every frame, on one core.

    python benchmarks/bench_clips.py [--seconds 60] [--size 640x360] [--fps 25] [--frames 8]

Input: a generated H.264 MP4 (`tests/mediafactory.make_video`: a key frame every second, a moving
square; cached under /tmp). Measured in this process, best of three:

  seek     `media.video.decode_frames` taking `--frames` frames spread uniformly (mmenc's path)
  all      PyAV decoding every frame of the clip (what sampling by decoding through costs)

Printed: milliseconds of each and the ratio all / seek, and the frames seek decoded. Real clips
often have key frames further apart (2 to 10 s): seeking then decodes more per sampled frame.

Then the transport of sampled frames from one decode worker: 64 clips (2 s, 320x240), 8 frames
each through CLIP's 224 preprocessing, with the frames in shared-memory slots (mmenc's default)
and pickled (no slots); printed: the encode process's CPU time per clip (`time.process_time`
over submitting, collecting and releasing) and the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmenc_cli.media import video  # noqa: E402
from tests import mediafactory as mf  # noqa: E402


def best(fn, runs: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--size", default="640x360")
    ap.add_argument("--fps", type=int, default=25)
    ap.add_argument("--frames", type=int, default=8)
    args = ap.parse_args()
    width, height = (int(x) for x in args.size.split("x"))
    path = Path(tempfile.gettempdir()) / f"mmenc-bench-{args.seconds:g}s-{args.size}-{args.fps}.mp4"
    if not path.exists():
        mf.make_video(path, "mp4", seconds=args.seconds, fps=args.fps, size=(width, height))

    import av

    decoded: list[float] = []
    real = video._decode

    def counting(container, stream):  # type: ignore[no-untyped-def]
        for frame in real(container, stream):
            decoded.append(frame.time)
            yield frame

    video._decode = counting  # type: ignore[assignment]
    seek = best(lambda: video.decode_frames(str(path), args.frames, None, 1e9, 10**9))
    video._decode = real  # type: ignore[assignment]

    def decode_all() -> int:
        with av.open(str(path)) as container:
            return sum(1 for _ in container.decode(video=0))

    total = decode_all()
    every = best(decode_all)
    print(f"clip: {args.seconds:g} s, {args.size}, {args.fps} fps, {total} frames, a key frame every second")
    print(f"seek ({args.frames} frames): {seek * 1000:.1f} ms, {len(decoded) // 3} frames decoded per clip")
    print(f"all frames:       {every * 1000:.1f} ms")
    print(f"all / seek:       {every / seek:.1f}x")
    transport()


def transport() -> None:
    """The encode process's CPU per clip with the frames in slots and pickled (module docstring)."""
    from mmenc_cli.config import MediaConfig
    from mmenc_cli.encoders.preprocess import PixelPreprocessor
    from mmenc_cli.run.decode_pool import DecodePool
    from mmenc_cli.run.decode_worker import Preprocessors

    folder = Path(tempfile.mkdtemp(prefix="mmenc-bench-clips-"))
    names = [mf.make_video(folder / f"{i}.mp4", "mp4", seconds=2.0, size=(320, 240), seed=i).name
             for i in range(8)] * 8
    pre = Preprocessors(image=PixelPreprocessor(None, 224, (224, 224), 3), frames=8)
    cpu = {}
    for slots in (2048, 0):
        pool = DecodePool(pre, MediaConfig(), workers=1, max_in_flight=4096, slots=slots)
        t0 = time.process_time()
        for i in range(0, len(names), 4):
            pool.submit(i, [(n, str(folder)) for n in names[i:i + 4]], modality="video")
        for _key, results in pool.drain():
            for dec in results:
                assert dec.error is None, dec.error
                pool.release(dec)
        cpu[slots > 0] = (time.process_time() - t0) / len(names)
        pool.close()
    print(f"transport, 8 frames a clip: shared memory {cpu[True] * 1000:.2f} ms, pickled {cpu[False] * 1000:.2f} ms "
          f"of encode-process CPU per clip ({cpu[False] / cpu[True]:.1f}x)")


if __name__ == "__main__":
    main()
