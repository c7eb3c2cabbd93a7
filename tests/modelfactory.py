"""Tiny, deterministic Hugging Face models built from configs with random weights, for offline tests.

Each `make_tiny_*` function writes a complete model folder (weights as safetensors, config, and the
processor / tokenizer files `from_pretrained` needs) into `path` and returns `path`. The models are
tiny (hidden 32, 2 layers, 32x32 images with 8x8 patches) so building one takes well under a second,
and seeded so two builds give identical weights. No network: the tokenizer is a small WordPiece
vocabulary made here (lower-case letters, digits, punctuation and a few words), so any ASCII text
tokenizes without [UNK] noise.
"""

from __future__ import annotations

import os

# Tests never reach the hub; set before anything imports huggingface_hub (it reads this at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import string
from pathlib import Path
from typing import Any

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4: CLS=2, SEP=3
WORDS = ["the", "a", "an", "photo", "of", "cat", "dog", "on", "in", "and", "is", "red", "blue", "car"]
_CHARS = string.ascii_lowercase + string.digits
VOCAB = SPECIALS + list(_CHARS + string.punctuation) + ["##" + c for c in _CHARS] + WORDS
PAD_ID, CLS_ID, SEP_ID = 0, 2, 3

TINY = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
IMAGE = dict(image_size=32, patch_size=8, num_channels=3)


def make_tokenizer(max_length: int) -> Any:
    """A tiny lower-casing BERT WordPiece tokenizer (no files needed), limited to `max_length` tokens."""
    from transformers import BertTokenizer

    return BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}, model_max_length=max_length)


def _save(path: str | os.PathLike, model: Any, *parts: Any) -> Path:
    """Save the model and each processor part into `path` (created if missing)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for part in parts:
        part.save_pretrained(out)
    return out


def _seeded(build: Any) -> Any:
    """Build a model with a fixed seed so every call gives the same weights."""
    import torch

    torch.manual_seed(0)
    return build().eval()


def make_tiny_clip(path: str | os.PathLike) -> Path:
    """A CLIP with image and text towers (projection 16). Text pools at the first [SEP] (eos id 3)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    text = dict(TINY, vocab_size=len(VOCAB), max_position_embeddings=32,
                pad_token_id=PAD_ID, bos_token_id=CLS_ID, eos_token_id=SEP_ID)
    config = CLIPConfig(text_config=text, vision_config=dict(TINY, **IMAGE), projection_dim=16)
    model = _seeded(lambda: CLIPModel(config))
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return _save(path, model, proc, make_tokenizer(32))


def make_tiny_siglip(path: str | os.PathLike) -> Path:
    """A SigLIP with image and text towers; text pools the last position, so it is padded to 16."""
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel

    text = dict(TINY, vocab_size=len(VOCAB), max_position_embeddings=16,
                pad_token_id=PAD_ID, bos_token_id=CLS_ID, eos_token_id=SEP_ID)
    config = SiglipConfig(text_config=text, vision_config=dict(TINY, **IMAGE))
    model = _seeded(lambda: SiglipModel(config))
    proc = SiglipImageProcessor(size={"height": 32, "width": 32})
    return _save(path, model, proc, make_tokenizer(16))


def make_tiny_siglip2(path: str | os.PathLike) -> Path:
    """A SigLIP 2 (NaFlex): its processor patchifies at native aspect ratio, so it cannot take
    the uint8 path and exercises the full-processor fallback (with extra model inputs)."""
    from transformers import Siglip2Config, Siglip2ImageProcessor, Siglip2Model

    text = dict(TINY, vocab_size=len(VOCAB), max_position_embeddings=16,
                pad_token_id=PAD_ID, bos_token_id=CLS_ID, eos_token_id=SEP_ID)
    vision = dict(TINY, num_channels=3, patch_size=8, num_patches=16)
    model = _seeded(lambda: Siglip2Model(Siglip2Config(text_config=text, vision_config=vision)))
    proc = Siglip2ImageProcessor(patch_size=8, max_num_patches=16)
    return _save(path, model, proc, make_tokenizer(16))


def make_tiny_vit(path: str | os.PathLike) -> Path:
    """A ViT backbone with its pooler (dense + tanh on CLS), image only, fixed 32x32 resize."""
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    model = _seeded(lambda: ViTModel(ViTConfig(**TINY, **IMAGE)))
    return _save(path, model, ViTImageProcessor(size={"height": 32, "width": 32}))


def make_tiny_dinov2(path: str | os.PathLike) -> Path:
    """A DINOv2 backbone, image only, with DINOv2's processor recipe (shortest edge, center crop)."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, **IMAGE)
    model = _seeded(lambda: Dinov2Model(config))
    proc = BitImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32},
                             image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    return _save(path, model, proc)


def make_tiny_st(path: str | os.PathLike, normalize: bool = True, pooling: str = "mean",
                 max_seq_length: int = 24, subfolder: str = "") -> Path:
    """A sentence-transformers folder: tiny BERT + Pooling (+ Normalize), legacy file layout.

    `pooling` is one ST mode name (`mean`, `cls`, `max`, `mean_sqrt_len_tokens`, `lasttoken`,
    `weightedmean`), written as the legacy `pooling_mode_*` flags most published models carry.
    `subfolder` puts the transformer in e.g. `0_Transformer/` instead of the root.
    """
    from transformers import BertConfig, BertModel

    out = Path(path)
    config = BertConfig(**TINY, vocab_size=len(VOCAB), max_position_embeddings=64, pad_token_id=PAD_ID)
    model = _seeded(lambda: BertModel(config))
    tdir = _save(out / subfolder, model, make_tokenizer(64))
    (tdir / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    flags = {"cls": "cls_token", "max": "max_tokens", "mean": "mean_tokens",
             "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "weightedmean": "weightedmean_tokens",
             "lasttoken": "lasttoken"}
    pool = {"word_embedding_dimension": TINY["hidden_size"]}
    pool.update({f"pooling_mode_{flag}": mode == pooling for mode, flag in flags.items()})
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    modules = [{"idx": 0, "name": "0", "path": subfolder, "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=1))
    return out


#: the tiny CLAP's feature extractor: 16 kHz, a 2 s window, 16 mel bins (the released models:
#: 48 kHz, 10 s, 64 bins); `fusion` builds the fusion variant (`enable_fusion`, extractor "fusion")
CLAP_RATE, CLAP_WINDOW_S = 16000, 2


def make_tiny_clap(path: str | os.PathLike, fusion: bool = False) -> Path:
    """A CLAP with audio (HTSAT, 2 stages) and text towers, projection 16, and its feature extractor."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

    audio = dict(hidden_size=32, num_mel_bins=16, spec_size=64, patch_size=4, window_size=4, depths=[1, 1],
                 num_attention_heads=[2, 2], patch_embeds_hidden_size=16, projection_dim=16,
                 enable_fusion=fusion, patch_stride=(4, 4))
    text = dict(TINY, vocab_size=len(VOCAB), max_position_embeddings=40, pad_token_id=PAD_ID,
                bos_token_id=CLS_ID, eos_token_id=SEP_ID, projection_dim=16)
    config = ClapConfig(text_config=text, audio_config=audio, projection_dim=16)
    model = _seeded(lambda: ClapModel(config))
    extractor = ClapFeatureExtractor(feature_size=16, sampling_rate=CLAP_RATE, hop_length=160,
                                     max_length_s=CLAP_WINDOW_S, fft_window_size=400, frequency_max=8000,
                                     truncation="fusion" if fusion else "rand_trunc", padding="repeatpad")
    return _save(path, model, extractor, make_tokenizer(32))
