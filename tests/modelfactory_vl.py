"""Tiny Qwen2-VL and Qwen2.5-VL models built from configs with random weights, for offline tests.

Each builder writes a whole model folder (`save_pretrained` of the full
`...ForConditionalGeneration`, so the checkpoint holds the language model too, the image processor
and, unless asked otherwise, a tiny Qwen2 BPE tokenizer) and returns its path. The vision towers
are tiny (embed 32, depth 2, 14-pixel patches, merge 2) and the image processor allows 4 to 16
merged tokens per image (`MIN_PIXELS`..`MAX_PIXELS`), so one forward takes milliseconds. Seeded:
two builds give identical weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import string
from pathlib import Path
from typing import Any

PATCH, MERGE, TEMPORAL = 14, 2, 2
FACTOR = PATCH * MERGE
MIN_PIXELS = FACTOR * FACTOR * 4   # at least 4 merged tokens per image
MAX_PIXELS = FACTOR * FACTOR * 16  # at most 16 merged tokens per image
HIDDEN = 48                        # the language model's hidden size = the merger's output dim

_TEXT = dict(vocab_size=128, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
             bos_token_id=0, eos_token_id=1, pad_token_id=1)


def make_image_processor() -> Any:
    """The Qwen2-VL image processor (PIL backend) with small min/max pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                    merge_size=MERGE, temporal_patch_size=TEMPORAL)


def make_video_processor() -> Any:
    """The Qwen2-VL video processor with the image processor's min/max pixels (clips' frames are
    given to it as they are: mmenc samples them)."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH,
                                 merge_size=MERGE, temporal_patch_size=TEMPORAL)


def make_qwen_tokenizer() -> Any:
    """A tiny byte-less Qwen2 BPE tokenizer (printable ASCII characters, no merges)."""
    from transformers import Qwen2Tokenizer

    chars = ["<|endoftext|>", "<|im_end|>"] + [c for c in string.printable if not c.isspace() or c == " "]
    return Qwen2Tokenizer(vocab={c: i for i, c in enumerate(chars)}, merges=[])


def _save(path: str | os.PathLike, model: Any, with_tokenizer: bool) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    make_image_processor().save_pretrained(out)
    make_video_processor().save_pretrained(out)
    if with_tokenizer:
        make_qwen_tokenizer().save_pretrained(out)
    return out


def _quiet() -> None:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)


def make_tiny_qwen2vl(path: str | os.PathLike, with_tokenizer: bool = True) -> Path:
    """A Qwen2-VL (vision embed 32, depth 2, merger to 48) with its image processor (+ tokenizer)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    _quiet()
    vision = dict(depth=2, embed_dim=32, hidden_size=HIDDEN, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL)
    config = Qwen2VLConfig(text_config=dict(_TEXT), vision_config=vision, image_token_id=2, video_token_id=3,
                           vision_start_token_id=4, vision_end_token_id=5)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    return _save(path, model, with_tokenizer)


def make_tiny_qwen25vl(path: str | os.PathLike, with_tokenizer: bool = True) -> Path:
    """A Qwen2.5-VL (window attention in block 0, full attention in block 1, merger to 48)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    _quiet()
    vision = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, out_hidden_size=HIDDEN,
                  window_size=56, fullatt_block_indexes=[1])
    config = Qwen2_5_VLConfig(text_config=dict(_TEXT), vision_config=vision, image_token_id=2, video_token_id=3,
                              vision_start_token_id=4, vision_end_token_id=5)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    return _save(path, model, with_tokenizer)


def reference_image_features(model_dir: str | os.PathLike, images: list[Any], dtype: Any = None) -> list[Any]:
    """The model's own reference: the full model's `get_image_features` through its own image
    processor (loaded from `model_dir`); one float32 `[tokens, dim]` tensor per image, plus grids."""
    import torch
    from transformers import AutoConfig, AutoImageProcessor

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration as cls
    else:
        from transformers import Qwen2VLForConditionalGeneration as cls
    model = cls.from_pretrained(model_dir, dtype=dtype or torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    out = []
    with torch.inference_mode():
        for image in images:
            inputs = processor(images=[image], return_tensors="pt")
            feats = model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            pooled = feats if isinstance(feats, (torch.Tensor, list, tuple)) else feats.pooler_output
            tensor = pooled[0] if isinstance(pooled, (list, tuple)) else pooled
            out.append((tensor.float(), tuple(int(x) for x in inputs["image_grid_thw"][0])))
    return out


def reference_video_features(model_dir: str | os.PathLike, clips: list[list[Any]]) -> list[Any]:
    """The model's own reference for video: the full model's `get_video_features` through its own
    video processor (frames given as they are); one float32 `[tokens, dim]` tensor per clip, plus grids."""
    import torch
    from transformers import AutoConfig, AutoVideoProcessor

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration as cls
    else:
        from transformers import Qwen2VLForConditionalGeneration as cls
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoVideoProcessor.from_pretrained(model_dir)
    out = []
    with torch.inference_mode():
        for frames in clips:
            inputs = processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
            feats = model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"])
            pooled = feats if isinstance(feats, (torch.Tensor, list, tuple)) else feats.pooler_output
            tensor = pooled[0] if isinstance(pooled, (list, tuple)) else pooled
            out.append((tensor.float(), tuple(int(x) for x in inputs["video_grid_thw"][0])))
    return out
