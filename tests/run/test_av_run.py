"""Audio and video items through the whole run: a CLAP over every audio format and every fault
(decoded in worker processes), a CLIP over video clips (the mean of sampled frames, against
transformers' own image call), folders and tar shards with audio and video members, resume,
retry rows, and the startup error without PyAV."""

from __future__ import annotations

import base64
import io
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from mmenc_cli.config import BatchConfig, MediaConfig, ModelConfig, RunConfig, WriterConfig  # noqa: E402
from mmenc_cli.errors import ModelLoadError  # noqa: E402
from mmenc_cli.media.audio import decode_audio  # noqa: E402
from mmenc_cli.media.video import decode_frames  # noqa: E402
from mmenc_cli.output import OutDir  # noqa: E402
from mmenc_cli.error_rows import retry_rows  # noqa: E402
from mmenc_cli.run.pipeline import run_encode  # noqa: E402
from tests import mediafactory as mf  # noqa: E402
from tests import modelfactory  # noqa: E402
from tests.conftest import make_image, write_jsonl  # noqa: E402
from tests.encoders.test_clap import reference_audio  # noqa: E402
from tests.runs import embeddings, error_rows  # noqa: E402


def cfg_for(manifest: Path, out: Path, model: Path, modalities: tuple[str, ...] | None = None,
            workers: int = 0, **media: object) -> RunConfig:
    return RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(model), device="cpu"),
                     writer=WriterConfig(out=str(out), shard_size=4), batch=BatchConfig(batch_size=4, workers=workers),
                     media=MediaConfig(fetch_retries=0, decode="exact", **media), modalities=modalities)  # type: ignore[arg-type]


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def tiny_clap(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return modelfactory.make_tiny_clap(tmp_path_factory.mktemp("models") / "clap")


def test_a_clap_run_over_every_audio_format_and_fault(tmp_path: Path, tiny_clap: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    good = {"wav": mf.make_audio(media / "a.wav", "wav", seconds=0.5),
            "flac": mf.make_audio(media / "b.flac", "flac", seconds=1.0, rate=44100, channels=2),
            "mp3": mf.make_audio(media / "c.mp3", "mp3", seconds=1.5, kind="noise"),
            "opus": mf.make_audio(media / "d.opus", "opus", seconds=3.0),  # over the model's 2 s window
            "m4a": mf.make_audio(media / "e.m4a", "m4a", seconds=1.0),
            "named": mf.wrong_extension(mf.make_audio(media / "f.wav", "wav"), media / "f.mp4")}
    rows = [{"id": k, "audio": p.name, "text": f"the sound {k}"} for k, p in good.items()]
    inline = "data:audio/wav;base64," + base64.b64encode(good["wav"].read_bytes()).decode()
    rows.append({"id": "inline", "audio": inline})
    good["inline"] = good["wav"]
    faults = {"truncated": (mf.truncate(good["m4a"], media / "t.m4a", 0.5).name, 400, "media.unreadable"),
              "codec": (mf.make_unknown_codec_wav(media / "u.wav").name, 415, "media.unsupported_format"),
              "silent": (mf.make_video(media / "v.mp4", "mp4").name, 422, "media.no_stream"),
              "missing": ("nope.wav", 404, "media.not_found"),
              "empty": ("empty.wav", 400, "media.empty")}
    (media / "empty.wav").write_bytes(b"")
    rows += [{"id": k, "audio": name} for k, (name, _, _) in faults.items()]
    manifest = write_jsonl(media / "m.jsonl", rows)

    res = run_encode(cfg_for(manifest, tmp_path / "out", tiny_clap, workers=1))
    audio = res.counters.mod("audio")
    assert res.counters.balanced and audio.requested == 12 and audio.encoded == 7 and audio.truncated == 1
    assert audio.failed == {400: 2, 415: 1, 422: 1, 404: 1} and res.counters.mod("text").encoded == 6
    errors = {r["id"]: (r["code"], r["reason"], r["modality"], r["source"]) for r in error_rows(tmp_path / "out")}
    assert errors == {k: (code, reason, "audio", name) for k, (name, code, reason) in faults.items()}

    got = embeddings(tmp_path / "out")
    samples = [decode_audio(str(good[k]), modelfactory.CLAP_RATE, modelfactory.CLAP_WINDOW_S)[0] for k in good]
    ref = unit(reference_audio(tiny_clap, samples))  # CLAP's convention: normalized
    np.testing.assert_allclose(np.stack([got[(k, "audio")] for k in good]), ref, atol=1e-5, rtol=0)

    again = run_encode(cfg_for(manifest, tmp_path / "out", tiny_clap))  # resume: nothing left to do
    assert again.counters.mod("audio").encoded == 0 and again.counters.mod("audio").encoded_before == 7
    retry = {r["id"]: r for r in retry_rows(tmp_path / "out", error_rows(tmp_path / "out"))}
    assert retry["codec"] == {"id": "codec", "audio": str(media / "u.wav")}


def reference_frames(clip_dir: Path, frames: list) -> np.ndarray:  # type: ignore[type-arg]
    """transformers' own call on a clip's frames: `[frames, dim]`, not normalized."""
    import torch
    from transformers import AutoImageProcessor, CLIPModel

    model = CLIPModel.from_pretrained(clip_dir).eval()
    processor = AutoImageProcessor.from_pretrained(clip_dir, backend="pil")  # transformers' reference resize
    pixels = processor(frames, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixels)
    return (out if isinstance(out, torch.Tensor) else out.pooler_output).numpy()


def reference_video(clip_dir: Path, frames: list) -> np.ndarray:  # type: ignore[type-arg]
    """The mean of the frames' embeddings, normalized (CLIP's convention)."""
    return unit(reference_frames(clip_dir, frames).mean(axis=0))


def test_a_clip_run_over_video_clips_is_the_mean_of_their_frames(tmp_path: Path, tiny_clip: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    clips = {"mp4": mf.make_video(media / "a.mp4", "mp4", seconds=2.0),
             "webm": mf.make_video(media / "b.webm", "webm", seconds=1.5, size=(80, 40)),
             "sound": mf.make_video(media / "c.mp4", "mp4", seconds=1.0, audio=True)}
    rows = [{"id": k, "video": p.name} for k, p in clips.items()]
    rows += [{"id": "audio-only", "video": mf.make_audio_only_mp4(media / "d.mp4").name},
             {"id": "cut", "video": mf.truncate(clips["mp4"], media / "e.mp4", 0.3).name},
             {"id": "photo", "image": make_image(media / "p.png").name, "text": "a photo"}]
    manifest = write_jsonl(media / "m.jsonl", rows)
    res = run_encode(cfg_for(manifest, tmp_path / "out", tiny_clip, ("image", "text", "video"), frames=4))
    video = res.counters.mod("video")
    assert res.counters.balanced and video.requested == 5 and video.encoded == 3 and video.failed == {422: 1, 400: 1}
    assert res.counters.mod("image").encoded == 1 and res.counters.mod("video").skipped == 1
    got = embeddings(tmp_path / "out")
    for key, path in clips.items():
        frames, _, _ = decode_frames(str(path), 4, None, 3600.0, 10**8)
        np.testing.assert_allclose(got[(key, "video")], reference_video(tiny_clip, frames), atol=1e-5, rtol=0)

    default = run_encode(cfg_for(manifest, tmp_path / "default", tiny_clip))  # video only when asked
    assert default.counters.mod("video").requested == 0 and default.counters.mod("image").encoded == 1


def test_the_frames_count_is_fingerprinted_as_resolved(tmp_path: Path, tiny_clip: Path) -> None:
    from mmenc_cli.errors import OutputError

    clip = mf.make_video(tmp_path / "a.mp4", "mp4", seconds=1.0)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "video": str(clip)}])
    assert run_encode(cfg_for(manifest, tmp_path / "out", tiny_clip, ("video",), frames=8)).counters.balanced
    again = run_encode(cfg_for(manifest, tmp_path / "out", tiny_clip, ("video",)))  # the default is 8 too
    assert again.counters.mod("video").encoded_before == 1
    with pytest.raises(OutputError, match="frames: output has 8, this run 4"):
        run_encode(cfg_for(manifest, tmp_path / "out", tiny_clip, ("video",), frames=4))


def test_pooling_frames_writes_each_clips_frame_embeddings(tmp_path: Path, tiny_clip: Path) -> None:
    from mmenc_cli.output.embeddings import iter_token_embeddings

    clips = {"a": mf.make_video(tmp_path / "a.mp4", "mp4", seconds=2.0),
             "b": mf.make_video(tmp_path / "b.webm", "webm", seconds=1.0)}
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": k, "video": str(p), "text": "x"} for k, p in clips.items()])
    cfg = cfg_for(manifest, tmp_path / "out", tiny_clip, frames=3)
    cfg = RunConfig(**{**cfg.__dict__, "model": ModelConfig(model=str(tiny_clip), device="cpu", pooling="frames"),
                       "writer": WriterConfig(out=str(tmp_path / "out"), format="safetensors", out_dtype="float32")})
    res = run_encode(cfg)  # the default modalities of --pooling frames: video
    assert res.counters.balanced and res.counters.mod("video").encoded == 2 and res.counters.mod("text").requested == 0
    got = {e.id: e.array for e in iter_token_embeddings(tmp_path / "out", modality="video")}
    for key, path in clips.items():
        frames, _, _ = decode_frames(str(path), 3, None, 3600.0, 10**8)
        assert got[key].shape == (3, 16)
        np.testing.assert_allclose(got[key], unit(reference_frames(tiny_clip, frames)), atol=1e-5, rtol=0)
    from mmenc_cli.export import export_vllm
    from mmenc_cli.errors import OutputError

    with pytest.raises(OutputError, match="--pooling frames"):  # at once, not at its first clip
        export_vllm(tmp_path / "out", tmp_path / "vllm")
    assert not (tmp_path / "vllm").exists()


def test_folders_and_tar_shards_hold_audio_and_video_members(tmp_path: Path, tiny_clap: Path,
                                                             tiny_clip: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    mf.make_audio(folder / "bird.flac", "flac")
    (folder / "bird.txt").write_text("a bird sings")
    mf.make_video(folder / "walk.webm", "webm")
    make_image(folder / "walk.png")  # with walk.webm: one sample of two media, named by the first
    make_image(folder / "cat.png")
    res = run_encode(cfg_for(folder, tmp_path / "clap", tiny_clap))
    assert res.counters.mod("audio").encoded == 1 and res.counters.mod("text").encoded == 1
    res = run_encode(cfg_for(folder, tmp_path / "clip", tiny_clip, ("image", "video")))
    assert res.counters.mod("video").encoded == 1 and res.counters.mod("image").encoded == 2
    assert set(embeddings(tmp_path / "clip")) == {("walk.png", "video"), ("walk.png", "image"), ("cat.png", "image")}
    assert res.counters.rows == 3 and res.counters.rows_skipped == 1  # bird.flac: audio, not asked

    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as tf:
        for key, name, data in (("s1", "flac", (folder / "bird.flac").read_bytes()), ("s1", "txt", b"birdsong"),
                                ("s2", "wav", mf.make_audio(tmp_path / "x.wav", "wav").read_bytes()),
                                ("s3", "wav", mf.make_unknown_codec_wav(tmp_path / "u.wav").read_bytes())):
            info = tarfile.TarInfo(f"{key}.{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    res = run_encode(cfg_for(shard, tmp_path / "tar", tiny_clap))
    assert res.counters.mod("audio").encoded == 2 and res.counters.mod("text").encoded == 1
    assert res.counters.mod("audio").failed == {415: 1}
    [retry] = retry_rows(tmp_path / "tar", error_rows(tmp_path / "tar"))  # the member inline, as a data URI
    assert retry["id"] == "s3" and retry["audio"].startswith("data:audio/wav;base64,")
    assert base64.b64decode(retry["audio"].split(",", 1)[1]) == (tmp_path / "u.wav").read_bytes()


def test_without_pyav_audio_and_video_stop_at_start_naming_the_extra(tmp_path: Path, tiny_clip: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # import av -> ImportError
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "video": "a.mp4", "image": "p.png"}])
    make_image(tmp_path / "p.png")
    loads: list[str] = []
    with pytest.raises(ModelLoadError, match=r'mmenc\[av\]'):  # before the model loads, before any output
        run_encode(cfg_for(manifest, tmp_path / "out", tiny_clip, ("image", "video")),
                   encoder_factory=lambda cfg, device=None: loads.append("load"))  # type: ignore[func-returns-value]
    assert loads == [] and not OutDir(tmp_path / "out").run_meta_path.exists()
    res = run_encode(cfg_for(manifest, tmp_path / "images", tiny_clip, ("image",)))  # images need no PyAV
    assert res.counters.mod("image").encoded == 1


def test_the_cli_takes_the_audio_and_video_options(tmp_path: Path, tiny_clap: Path) -> None:
    import json

    from typer.testing import CliRunner

    from mmenc_cli.cli import app

    long = mf.make_audio(tmp_path / "long.flac", "flac", seconds=1.5)
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"key": "a", "sound": str(long)},
                                                  {"key": "b", "sound": str(tmp_path / "nope.wav")}])
    res = CliRunner().invoke(app, [str(a) for a in (
        "encode", manifest, "--out", tmp_path / "out", "--model", tiny_clap, "--id-key", "key", "--audio-key", "sound",
        "--modality", "audio", "--max-audio-seconds", "0.5", "--max-audio-bytes", 10**6, "--workers", 0,
        "--progress", "none", "--json")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    result = json.loads(res.stdout)
    audio = result["counters"]["modalities"]["audio"]
    assert (audio["encoded"], audio["truncated"], audio["failed"]) == (1, 1, {"404": 1})
    assert "audio" in res.stderr  # the summary's line for the medium
    config = json.loads((tmp_path / "out" / "_mmenc" / "run.json").read_text())["config"]
    assert config["media"]["max_audio_seconds"] == 0.5 and config["manifest"]["audio_key"] == "sound"
