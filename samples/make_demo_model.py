"""Write `mmenc_cli/demo_model/` (shipped in the package): a tiny CLIP-architecture model with random weights, for trying mmenc offline.

The embeddings it produces are meaningless; it only lets the whole pipeline (images and texts,
workers, batching, writers) run without downloading anything. Seeded, so every run writes the
same weights. Usage: `python samples/make_demo_model.py [OUT_DIR]`.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

README = """\
# DEMO model: random weights, meaningless embeddings

This folder holds a **demo model for trying mmenc offline**. It has the CLIP architecture
(image tower: 64x64 pixels, 16x16 patches; text tower: a small WordPiece vocabulary of letters,
digits and a few words) but its weights are **random** (seed 0): the embeddings it produces
carry **no meaning** and must not be used for search, clustering or anything else.

It ships inside the mmenc package and is what `mmenc encode` uses when no `--model` is given (with
a warning). Use it to check an installation or a manifest end to end. It loads on CPU in a second
and needs no network.

Regenerate it with `python samples/make_demo_model.py` (deterministic: same seed, same weights).
"""

WORDS = ["the", "a", "an", "of", "and", "in", "on", "with", "photo", "picture", "image", "cat", "dog",
         "car", "person", "red", "blue", "green", "is", "this"]


def build(out: Path) -> Path:
    """Create the model, its tokenizer and image processor, and save them with a README to `out`."""
    import torch
    from transformers import BertTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    chars = string.ascii_lowercase + string.digits
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(chars + string.punctuation) \
        + ["##" + c for c in chars] + WORDS
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=77)
    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    # CLIP pools the text at eos_token_id: the tokenizer ends every text with [SEP] (id 3)
    text = dict(tower, vocab_size=len(vocab), max_position_embeddings=77,
                pad_token_id=0, bos_token_id=2, eos_token_id=3)
    config = CLIPConfig(text_config=text, vision_config=dict(tower, image_size=64, patch_size=16),
                        projection_dim=64)
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "README.md").write_text(README)
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "mmenc_cli" / "demo_model"
    path = build(target)
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"wrote {path} ({size / 1e6:.1f} MB)")
