"""Qwen2-VL / Qwen2.5-VL video tokens against the full model's own `get_video_features` through
its own video processor; a run with `--pooling tokens` over real clips (token counts, grids, one
error row per broken clip, a token-count mismatch bisected to its clip) and the vLLM export of
`video_embeds` + `video_grid_thw`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("torchvision")  # transformers' video processors run on torchvision

from mmenc_cli.config import BatchConfig, MediaConfig, ModelConfig, RunConfig, WriterConfig  # noqa: E402
from mmenc_cli.encoders import load_encoder  # noqa: E402
from mmenc_cli.export import export_vllm  # noqa: E402
from mmenc_cli.media.video import decode_frames  # noqa: E402
from mmenc_cli.output.embeddings import iter_token_embeddings  # noqa: E402
from mmenc_cli.run.decode_worker import Preprocessors, decode_one  # noqa: E402
from mmenc_cli.run.pipeline import run_encode  # noqa: E402
from tests import mediafactory as mf  # noqa: E402
from tests import modelfactory_vl as vl  # noqa: E402
from tests.conftest import write_jsonl  # noqa: E402
from tests.fakes import factory  # noqa: E402
from tests.runs import error_rows  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2vl", "qwen25vl"])
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = vl.make_tiny_qwen2vl if request.param == "qwen2vl" else vl.make_tiny_qwen25vl
    return make(tmp_path_factory.mktemp("vl") / request.param)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clips")
    return {"a": mf.make_video(root / "a.mp4", "mp4", seconds=2.0, size=(64, 48)),
            "b": mf.make_video(root / "b.webm", "webm", seconds=1.0, size=(96, 40)),
            "c": mf.make_video(root / "c.mp4", "mp4", seconds=3.0, size=(56, 56), audio=True)}


def test_video_tokens_equal_the_models_own_get_video_features(qwen: Path, clips: dict[str, Path]) -> None:
    enc = load_encoder(ModelConfig(model=str(qwen), pooling="tokens", device="cpu"))
    assert enc.modalities == {"image", "video"}
    pre = Preprocessors(image=enc.image_preprocessor(), video=enc.video_preprocessor(), frames=5)
    decoded = [decode_one(str(p), "", pre, MediaConfig(), modality="video") for p in clips.values()]
    assert all(d.error is None for d in decoded)
    out = enc.encode("video", [d.value for d in decoded]).vectors  # one batch of three clips
    frames = [decode_frames(str(p), 5, None, 3600.0, 10**8)[0] for p in clips.values()]
    ref = vl.reference_video_features(qwen, frames)
    for got, dec, (want, grid) in zip(out, decoded, ref):
        assert grid[0] == 3  # 5 frames in temporal patches of 2: the last frame repeated
        assert dec.value.meta["video_grid_thw"] == grid and got.shape == (grid[0] * grid[1] * grid[2] // 4, vl.HIDDEN)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5)


def cfg(manifest: Path, out: Path, model: Path, batch_size: int = 4) -> RunConfig:
    return RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(model), pooling="tokens", device="cpu"),
                     writer=WriterConfig(out=str(out), format="safetensors", out_dtype="float32", shard_size=3),
                     batch=BatchConfig(batch_size=batch_size, workers=0), media=MediaConfig(frames=4),
                     modalities=("video",))


@pytest.mark.parametrize("family", ["qwen2vl", "qwen25vl"])
def test_a_token_run_over_clips_and_the_vllm_export(tmp_path: Path, clips: dict[str, Path], family: str) -> None:
    model = (vl.make_tiny_qwen2vl if family == "qwen2vl" else vl.make_tiny_qwen25vl)(tmp_path / "q")
    silent = mf.make_audio_only_mp4(tmp_path / "silent.mp4")
    rows = [{"id": k, "video": str(p)} for k, p in clips.items()]
    cut = mf.truncate(clips["a"], tmp_path / "t.mp4")
    rows += [{"id": "silent", "video": str(silent)}, {"id": "cut", "video": str(cut)}]
    manifest = write_jsonl(tmp_path / "m.jsonl", rows)
    res = run_encode(cfg(manifest, tmp_path / "out", model))
    video = res.counters.mod("video")
    assert res.counters.balanced and video.encoded == 3 and video.failed == {422: 1, 400: 1}
    tokens = {e.id: (e.array, e.grid) for e in iter_token_embeddings(tmp_path / "out", modality="video")}
    ref = vl.reference_video_features(model, [decode_frames(str(clips[k]), 4, None, 3600.0, 10**8)[0] for k in clips])
    for key, (want, grid) in zip(clips, ref):
        assert tokens[key][1] == grid
        np.testing.assert_allclose(tokens[key][0], want.numpy(), rtol=0, atol=1e-5)

    result = export_vllm(tmp_path / "out", tmp_path / "vllm")
    assert result.items == 3
    from safetensors.numpy import load_file

    for line in (tmp_path / "vllm" / "manifest.jsonl").read_text().splitlines():
        import json

        row = json.loads(line)
        saved = load_file(tmp_path / "vllm" / row["file"])
        # Qwen2.5-VL's temporal positions: 2 frames a patch x the seconds between the 4 sampled
        # frames (clips of 2, 1 and 3 s: 0.5, 0.25 and 0.75 s)
        seconds = {"a": 1.0, "b": 0.5, "c": 1.5}[row["id"]]
        if family == "qwen25vl":
            assert saved.pop("second_per_grid_ts").tolist() == [seconds] and row["second_per_grid_ts"] == seconds
        assert row["modality"] == "video" and set(saved) == {"video_embeds", "video_grid_thw"}
        assert saved["video_grid_thw"].tolist() == [list(tokens[row["id"]][1])]
        np.testing.assert_array_equal(saved["video_embeds"], tokens[row["id"]][0])


def test_a_token_count_mismatch_fails_only_its_clip(tmp_path: Path, clips: dict[str, Path]) -> None:
    import torch

    model = vl.make_tiny_qwen2vl(tmp_path / "q")
    enc = load_encoder(ModelConfig(model=str(model), pooling="tokens", device="cpu"))
    tower = enc.tower
    guilty_rows = vl.reference_video_features(model, [decode_frames(str(clips["b"]), 4, None, 3600.0, 10**8)[0]])
    guilty = guilty_rows[0][1]

    def faulty(pixel_values: Any, grid: Any) -> Any:  # one token too few for clip "b"
        parts = list(torch.split(tower(pixel_values, grid), (grid.prod(-1) // 4).tolist()))
        return torch.cat([p[:-1] if tuple(g.tolist()) == guilty else p for p, g in zip(parts, grid)])

    enc.tower = faulty
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": k, "video": str(p)} for k, p in clips.items()])
    res = run_encode(cfg(manifest, tmp_path / "out", model), encoder_factory=factory(enc))
    assert res.counters.balanced and res.counters.mod("video").encoded == 2
    expected = guilty[0] * guilty[1] * guilty[2] // 4
    assert [(e["id"], e["code"], e["reason"], e["message"]) for e in error_rows(tmp_path / "out")] == [
        ("b", 500, "encode.token_mismatch",
         f"Encoder produced {expected - 1} tokens, but preprocessing expected {expected}")]


def test_the_workers_get_only_what_the_run_encodes(tmp_path: Path, clips: dict[str, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An image run of a VL model must not ship its video processor (it imports torch) to the workers."""
    from PIL import Image

    from mmenc_cli.run.decode_pool import DecodePool

    seen: list[Preprocessors] = []
    real = DecodePool.__init__

    def init(self: DecodePool, pre: Preprocessors, *args: Any, **kwargs: Any) -> None:
        seen.append(pre)
        real(self, pre, *args, **kwargs)

    monkeypatch.setattr(DecodePool, "__init__", init)
    model = vl.make_tiny_qwen2vl(tmp_path / "q")
    Image.new("RGB", (60, 40), (9, 99, 199)).save(tmp_path / "p.png")
    manifest = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "image": "p.png", "video": str(clips["a"])}])
    image_only = RunConfig(**{**cfg(manifest, tmp_path / "img", model).__dict__, "modalities": ("image",)})
    assert run_encode(image_only).counters.mod("image").encoded == 1
    assert run_encode(cfg(manifest, tmp_path / "vid", model)).counters.mod("video").encoded == 1
    assert seen[0].image is not None and seen[0].video is None
    assert seen[1].video is not None
