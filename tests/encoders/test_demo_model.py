"""The demo model shipped in the package (mmenc_cli/demo_model) loads offline, encodes both modalities, is labelled."""

from __future__ import annotations

from PIL import Image

from tests import modelfactory as mf  # noqa: F401  (sets HF_HUB_OFFLINE)
from mmenc_cli.config import ModelConfig
from mmenc_cli.cli.encode import DEMO_MODEL as DEMO
from mmenc_cli.encoders import load_encoder


def test_demo_model_is_small_labelled_and_works() -> None:
    assert sum(f.stat().st_size for f in DEMO.iterdir()) <= 4 * 1024 * 1024
    readme = (DEMO / "README.md").read_text()
    assert "DEMO" in readme and "random weights" in readme and "meaningless" in readme
    encoder = load_encoder(ModelConfig(model=str(DEMO), device="cpu"))
    assert encoder.modalities == {"image", "text", "video"} and encoder.info["image_input"] == "uint8"
    prep = encoder.image_preprocessor()
    images = encoder.encode("image", [prep(Image.new("RGB", (97, 61), (200, 30, 30)))]).vectors
    texts = encoder.encode("text", ["a red car", "a photo of a dog"]).vectors
    assert images.shape == (1, encoder.dim) and texts.shape == (2, encoder.dim)
