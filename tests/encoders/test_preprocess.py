"""The split image path: torch-free uint8 resize+crop in workers, exact normalization on the device.

Tolerance: exact (max |diff| == 0). Resize and crop are the same PIL/numpy operations on the same
uint8 pixels as transformers' PIL processor, and the device lookup table holds the processor's own
float32 result for each (channel, uint8 value), computed with the same numpy operations
(float64 rescale cast to float32, float32 normalize). Nothing is rounded differently.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests import modelfactory as mf  # noqa: F401  (sets HF_HUB_OFFLINE before transformers loads)
from mmenc_cli.encoders.preprocess import (PixelPreprocessor, ProcessorPreprocessor, center_crop,
                                       plan_image_input)

REPO = Path(__file__).resolve().parents[2]
SIZES = [(37, 53), (64, 31), (200, 121), (32, 32), (9, 300), (31, 33)]  # (height, width)


def make_images() -> list[Image.Image]:
    """Noise images of odd sizes, plus a grayscale and a transparent one."""
    rng = np.random.RandomState(0)
    images = [Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    images.append(Image.fromarray(rng.randint(0, 256, (45, 23), dtype=np.uint8), mode="L"))
    images.append(Image.fromarray(rng.randint(0, 256, (40, 50, 4), dtype=np.uint8), mode="RGBA"))
    return images


def split_path(processor, images: list[Image.Image]) -> np.ndarray:
    """Worker step then the device step (as `HFEncoder.collate_images` does it), on CPU."""
    prep, table = plan_image_input(processor)
    assert isinstance(prep, PixelPreprocessor)
    items = [prep(img) for img in images]
    assert all(it.pixels.dtype == np.uint8 for it in items)
    pixels = torch.from_numpy(np.stack([it.pixels for it in items]))
    offsets = (torch.arange(3, dtype=torch.int32) * 256).view(1, 3, 1, 1)
    return torch.from_numpy(table).reshape(-1)[pixels.int() + offsets].numpy()


def processors():
    # the PIL-backend classes: with torchvision installed the plain names are the torchvision
    # backend, which mmenc never loads (`loading.load_part` asks for backend="pil")
    from transformers import (BitImageProcessorPil as BitImageProcessor, CLIPImageProcessorPil as CLIPImageProcessor,
                              SiglipImageProcessorPil as SiglipImageProcessor, ViTImageProcessorPil as ViTImageProcessor)

    return {
        "clip": CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        "clip-224": CLIPImageProcessor(),
        "siglip": SiglipImageProcessor(size={"height": 32, "width": 32}),
        "vit": ViTImageProcessor(size={"height": 30, "width": 26}),
        "dinov2": BitImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32},
                                    image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]),
        # crop larger than the resized image: transformers zero-pads, so must we
        "pad-crop": CLIPImageProcessor(size={"shortest_edge": 24}, crop_size={"height": 32, "width": 40}),
        "no-normalize": ViTImageProcessor(size={"height": 16, "width": 16}, do_normalize=False),
    }


@pytest.mark.parametrize("name", list(processors()))
def test_split_path_equals_processor_exactly(name: str) -> None:
    processor = processors()[name]
    images = make_images()
    if not processor.do_convert_rgb:  # such processors cannot take gray/RGBA images at all
        images = [img for img in images if img.mode == "RGB"]
    reference = processor(images=images, return_tensors="np")["pixel_values"]
    ours = split_path(processor, images)
    assert ours.dtype == np.float32 and ours.shape == reference.shape
    assert np.abs(ours - reference).max() == 0.0


def test_center_crop_matches_transformers() -> None:
    from transformers.image_transforms import center_crop as hf_center_crop

    pixels = np.arange(3 * 7 * 10, dtype=np.uint8).reshape(3, 7, 10)
    for h, w in [(4, 4), (7, 10), (9, 5), (12, 13), (3, 11)]:
        assert np.array_equal(center_crop(pixels, h, w), hf_center_crop(pixels, (h, w)))


def test_unsplittable_processor_falls_back_to_full_processor() -> None:
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 32, "longest_edge": 48}, do_center_crop=False)
    prep, table = plan_image_input(processor)
    assert isinstance(prep, ProcessorPreprocessor) and table is None
    image = make_images()[0]
    item = pickle.loads(pickle.dumps(prep))(image)  # it crosses into worker processes too
    assert item.pixels.dtype == np.float32
    assert np.array_equal(item.pixels, processor(images=[image], return_tensors="np")["pixel_values"][0])


def heavy_modules_after(code: str) -> str:
    """Run `code` in a fresh interpreter; which of torch/transformers it ended up importing."""
    code += "\nprint(','.join(m for m in ('torch', 'transformers') if m in sys.modules) or 'clean')\n"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_worker_preprocessor_pickles_and_never_imports_torch() -> None:
    from transformers import CLIPImageProcessorPil as CLIPImageProcessor

    prep, _ = plan_image_input(CLIPImageProcessor(size={"shortest_edge": 32},
                                                  crop_size={"height": 32, "width": 32}))
    code = (
        "import pickle\n"
        "from PIL import Image\n"
        f"prep = pickle.loads({pickle.dumps(prep)!r})\n"
        "item = prep(Image.new('RGB', (50, 40), (1, 2, 3)))\n"
        "assert item.pixels.dtype.name == 'uint8' and item.pixels.shape == (3, 32, 32)\n"
    )
    assert heavy_modules_after(code) == "clean"


def test_importing_encoders_does_not_import_torch() -> None:
    assert heavy_modules_after("import mmenc_cli.encoders, mmenc_cli.encoders.preprocess") == "clean"
