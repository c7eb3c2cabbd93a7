"""Regenerate the bundled sample manifest and images (deterministic; run from anywhere)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
FORMATS = [("jpg", "JPEG", (320, 240)), ("png", "PNG", (128, 128)), ("webp", "WEBP", (200, 150)),
           ("gif", "GIF", (96, 64)), ("bmp", "BMP", (48, 48)), ("tiff", "TIFF", (160, 90)),
           ("jpg", "JPEG", (90, 300)), ("png", "PNG", (640, 120)), ("jpg", "JPEG", (256, 256)),
           ("png", "PNG", (33, 77)), ("webp", "WEBP", (400, 300)), ("jpg", "JPEG", (120, 80)),
           ("png", "PNG", (64, 64)), ("jpg", "JPEG", (300, 200))]
TEXTS = ["a red car parked on a quiet street", "two cats sleeping on a blue sofa",
         "a bowl of fresh fruit on a wooden table", "mountains reflected in a calm lake at dawn",
         "a child flying a kite on the beach", "an old map with a compass", "city lights at night",
         "a cup of coffee next to an open book", "snow falling on a pine forest",
         "a dog catching a frisbee in the park", "sunflowers in a field", "a lighthouse in a storm"]


def picture(size: tuple[int, int], seed: int) -> Image.Image:
    """A smooth gradient with a few shapes: compresses like a photo, unlike noise."""
    w, h = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x / max(w - 1, 1)) * 255, (y / max(h - 1, 1)) * 255,
                     np.full((h, w), rng.integers(0, 255))], -1)
    img = Image.fromarray(base.astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = rng.integers(0, max(w // 2, 1)), rng.integers(0, max(h // 2, 1))
        draw.ellipse([x0, y0, x0 + w // 3, y0 + h // 3], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    return img


def main() -> None:
    (HERE / "images").mkdir(exist_ok=True)
    rows = []
    for i, (ext, fmt, size) in enumerate(FORMATS):
        name = f"images/img{i:02d}.{ext}"
        img = picture(size, i)
        (img.convert("P") if fmt == "GIF" else img).save(HERE / name, format=fmt)
        row = {"id": f"sample-{i:02d}", "image": name, "source": fmt.lower()}
        if i % 2 == 0:
            row["text"] = TEXTS[i % len(TEXTS)]
        rows.append(row)
    for j in range(6):
        rows.append({"id": f"sample-{len(FORMATS) + j:02d}", "text": TEXTS[(j * 5 + 1) % len(TEXTS)], "source": "text"})
    rows += failing_rows()
    with open(HERE / "manifest.jsonl", "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def failing_rows() -> list[dict[str, str]]:
    """Three rows that fail, so `mmenc errors` shows something on the first try: a missing file (its
    text still encodes), a JPEG cut short, an empty text."""
    import io

    buf = io.BytesIO()
    picture((160, 120), 99).save(buf, format="JPEG")
    (HERE / "images" / "broken.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    n = len(FORMATS) + 6
    return [{"id": f"sample-{n:02d}", "image": "images/missing.jpg", "source": "missing",
             "text": "a photo that is not there"},
            {"id": f"sample-{n + 1:02d}", "image": "images/broken.jpg", "source": "broken"},
            {"id": f"sample-{n + 2:02d}", "text": "", "source": "empty"}]


if __name__ == "__main__":
    main()
