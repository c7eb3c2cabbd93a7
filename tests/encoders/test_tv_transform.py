"""The uint8 split of torchvision evaluation transforms (OpenCLIP's, timm's) equals the transform
itself bit for bit, crops that pad included; anything else runs whole in the worker."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc_cli.encoders.preprocess import PixelPreprocessor
from mmenc_cli.encoders.tv_transform import TransformPreprocessor, plan_transform
from tests.modelfactory_libs import need

SIZES = [(37, 53), (64, 31), (200, 121), (32, 32), (9, 300), (31, 33), (17, 17)]  # (height, width)


def transforms() -> dict[str, object]:
    need("torchvision")
    from torchvision import transforms as T

    norm = T.Normalize(mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711))
    return {
        "openclip": T.Compose([T.Resize(32, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(32),
                               T.ToTensor(), norm]),
        "timm": T.Compose([T.Resize(35, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop((32, 32)),
                           T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))]),
        "fixed-bilinear": T.Compose([T.Resize((30, 26)), T.ToTensor(), norm]),
        # crop larger than the resized image: torchvision zero-pads (before normalizing), so must we
        "pad-crop": T.Compose([T.Resize(24, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop((32, 41)),
                               T.ToTensor(), norm]),
        "odd-crop": T.Compose([T.Resize(37, interpolation=T.InterpolationMode.NEAREST), T.CenterCrop((30, 34)),
                               T.ToTensor(), norm]),
    }


@pytest.mark.parametrize("name", ["openclip", "timm", "fixed-bilinear", "pad-crop", "odd-crop"])
def test_split_equals_the_transform_exactly(name: str) -> None:
    transform = transforms()[name]
    prep, table = plan_transform(transform)
    assert isinstance(prep, PixelPreprocessor) and table is not None
    prep = pickle.loads(pickle.dumps(prep))  # what crosses to the workers
    rng = np.random.RandomState(0)
    for h, w in SIZES:
        image = Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8))
        pixels = prep(image).pixels
        assert pixels.dtype == np.uint8
        ours = np.stack([table[c][pixels[c]] for c in range(3)])
        np.testing.assert_array_equal(ours, transform(image).numpy())


def test_other_transforms_run_whole_in_the_worker() -> None:
    need("torchvision")
    from torchvision import transforms as T

    transform = T.Compose([T.Resize(32), T.Pad(2), T.ToTensor()])
    prep, table = plan_transform(transform)
    assert isinstance(prep, TransformPreprocessor) and table is None
    image = Image.fromarray(np.full((20, 30, 3), 7, dtype=np.uint8))
    got = pickle.loads(pickle.dumps(prep))(image).pixels
    assert got.dtype == np.float32 and torch.equal(torch.from_numpy(got), transform(image))
