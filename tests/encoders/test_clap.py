"""CLAP against transformers' own calls: `get_audio_features` on the model's feature extractor's
output for the same samples, and `get_text_features` on the tokenizer's, to 1e-5; on tiny
random-weight models (plain and fusion), generated audio of several lengths and source rates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from mmenc_cli.config import MediaConfig, ModelConfig  # noqa: E402
from mmenc_cli.encoders import load_encoder  # noqa: E402
from mmenc_cli.run.decode_worker import Preprocessors, decode_one  # noqa: E402
from tests import mediafactory as mf  # noqa: E402
from tests import modelfactory  # noqa: E402


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "fusion"])
def clap(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return modelfactory.make_tiny_clap(tmp_path_factory.mktemp("clap") / "m", fusion=request.param)


def reference_audio(model_dir: Path, samples: list[np.ndarray]) -> np.ndarray:
    """transformers' own call, one clip at a time as its extractor prepares one clip."""
    import torch
    from transformers import ClapFeatureExtractor, ClapModel

    model = ClapModel.from_pretrained(model_dir).eval()
    extractor = ClapFeatureExtractor.from_pretrained(model_dir)
    out = []
    with torch.no_grad():
        for x in samples:
            inputs = extractor(x, sampling_rate=extractor.sampling_rate, return_tensors="pt")
            out.append(model.get_audio_features(**inputs).pooler_output[0].numpy())
    return np.stack(out)


def test_audio_embeddings_match_the_models_own_call(clap: Path, tmp_path: Path) -> None:
    encoder = load_encoder(ModelConfig(model=str(clap), device="cpu"))
    assert encoder.modalities == {"audio", "text"} and encoder.info["family"] == "clap"
    pre = Preprocessors(audio=encoder.audio_preprocessor())
    assert (pre.audio.sample_rate, pre.audio.window_seconds) == (modelfactory.CLAP_RATE, modelfactory.CLAP_WINDOW_S)
    files = [mf.make_audio(tmp_path / "a.wav", "wav", seconds=0.5, rate=16000),
             mf.make_audio(tmp_path / "b.flac", "flac", seconds=1.5, rate=44100, channels=2),
             mf.make_audio(tmp_path / "c.mp3", "mp3", seconds=2.0, rate=22050, kind="noise"),
             mf.make_audio(tmp_path / "d.opus", "opus", seconds=3.0, rate=48000)]  # over the 2 s window
    decoded = [decode_one(str(f), "", pre, MediaConfig(), modality="audio") for f in files]
    assert all(d.error is None for d in decoded)
    assert [d.value.meta["cut"] for d in decoded] == [False, False, False, True]
    got = encoder.encode("audio", [d.value for d in decoded]).vectors.numpy()  # one batch of four
    # the reference gets the samples mmenc decoded (mono, at the model's rate, cut to its window)
    from mmenc_cli.media.audio import decode_audio

    samples = [decode_audio(str(f), modelfactory.CLAP_RATE, modelfactory.CLAP_WINDOW_S)[0] for f in files]
    assert [len(s) for s in samples][-1] == modelfactory.CLAP_RATE * modelfactory.CLAP_WINDOW_S
    np.testing.assert_allclose(got, reference_audio(clap, samples), atol=1e-5, rtol=0)
    again = decode_one(str(files[3]), "", pre, MediaConfig(), modality="audio").value
    for key, value in decoded[3].value.features.items():  # deterministic: no random crop
        np.testing.assert_array_equal(again.features[key], value)


def test_text_embeddings_match_the_models_own_call(clap: Path) -> None:
    import torch
    from transformers import AutoTokenizer, ClapModel

    encoder = load_encoder(ModelConfig(model=str(clap), device="cpu"))
    texts = ["a dog barks", "the sound of rain on a car", "a"]
    got = encoder.encode("text", texts).vectors.numpy()
    model = ClapModel.from_pretrained(clap).eval()
    tokens = AutoTokenizer.from_pretrained(clap)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = model.get_text_features(input_ids=tokens["input_ids"],
                                      attention_mask=tokens["attention_mask"]).pooler_output.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
