"""Export token embeddings for serving engines: `mmenc export vllm OUT DEST`.

vLLM accepts precomputed Qwen2-VL / Qwen2.5-VL image embeddings in place of the image itself
(vLLM docs, docs/features/multimodal_inputs.md, "Embedding Inputs" -> "Image Embeddings", the
Qwen2-VL variant; followed as of vLLM 0.11.1+, where the engine needs `enable_mm_embeds=True` /
`--enable-mm-embeds`)::

    multi_modal_data = {"image": {"image_embeds": Tensor[tokens, hidden of LM],
                                  "image_grid_thw": Tensor[1, 3]}}   # (t, h, w), int64

`export_vllm` writes, per image, `DEST/<safe id>.safetensors` holding exactly those two tensors
(`image_embeds` in the output's dtype: float16 by default, float32, or bfloat16 which needs torch;
`image_grid_thw` int64 `[1, 3]`) and `DEST/manifest.jsonl`, one line per image: `id`, `file`,
`tokens`, `dim`, `dtype`, `image_grid_thw`, `orig_width`, `orig_height`. Feeding one image::

    from safetensors.torch import load_file
    from vllm import LLM

    llm = LLM("Qwen/Qwen2-VL-2B-Instruct", enable_mm_embeds=True, limit_mm_per_prompt={"image": 1})
    t = load_file("DEST/<file from manifest.jsonl>")
    prompt = ("<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>"
              "Describe this image.<|im_end|>\\n<|im_start|>assistant\\n")
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": {
        "image_embeds": t["image_embeds"], "image_grid_thw": t["image_grid_thw"]}}})

Video clips (`--modality video` with a Qwen2-VL model) are written the same way as vLLM's video
embedding inputs take them: `video_embeds` + `video_grid_thw` (the clip's temporal patches, t, and
merged grid), fed as `{"video": {"video_embeds": ..., "video_grid_thw": ...}}` with
`<|vision_start|><|video_pad|><|vision_end|>` in the prompt. Each `manifest.jsonl` line says its
`modality` and carries `image_grid_thw` or `video_grid_thw`; a Qwen2.5-VL clip's file and line
also hold `second_per_grid_ts` (float32 `[1]`: temporal_patch_size x the seconds between its
sampled frames), which vLLM's Qwen2.5-VL video embedding input takes as an optional tensor.

Several images in one prompt: concatenate their `image_embeds` along dim 0 and their
`image_grid_thw` rows (`[n, 3]`), in prompt order. The embeddings must come from the vision tower
of the same model (and `min_pixels`/`max_pixels` the server would use do not matter: the grid
travels with the embedding).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import OutputError
from .output import OutDir, open_output
from .output.fs import LOCAL

MANIFEST = "manifest.jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class ExportResult:
    """What an export wrote."""

    dest: str
    items: int
    tokens: int
    dtype: str | None
    manifest: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dict(self.__dict__)


def export_filename(id: str, modality: str = "image") -> str:
    """A file name for `id` that is safe on any filesystem and never collides: the id with unsafe
    characters replaced (at most 64 kept), then 16 hex digits of its SHA-256 (and `.video` for a
    video clip, so an image and a clip never share a name)."""
    stem = _UNSAFE.sub("_", id).strip("._")[:64] or "item"
    kind = "" if modality == "image" else f".{modality}"
    return f"{stem}-{hashlib.sha256(id.encode('utf-8')).hexdigest()[:16]}{kind}.safetensors"


def export_vllm(out: "str | Path | OutDir", dest: str | Path, *, overwrite: bool = False) -> ExportResult:
    """Write the `image_embeds` + `image_grid_thw` files (`video_...` for video clips) and
    `manifest.jsonl` of every image and video item of the token output `out` into `dest` (see the
    module docstring).

    `dest` must be empty, missing, or (with `overwrite`) a previous export, whose files are
    removed first. Raises `OutputError` when `out` is not a token output.
    """
    from .output.embeddings import iter_token_embeddings

    od = open_output(out)
    facts = (od.read_run_meta() or {}).get("facts") or {}
    if facts.get("output_kind") != "tokens":
        raise OutputError(f"{od.root} is not a --pooling tokens output (nothing to export to vLLM)")
    if facts.get("pooling") == "frames":
        raise OutputError(f"{od.root} holds --pooling frames embeddings (one vector per frame, no grid): "
                          "vLLM takes a VL model's --pooling tokens output")
    dtype = facts.get("out_dtype")
    dest = Path(dest).expanduser().absolute()
    _prepare_dest(dest, overwrite)
    framework = "pt" if dtype == "bfloat16" else "np"
    counts = [0, 0]  # items, tokens
    LOCAL.publish(dest / MANIFEST, lambda path: _write_items(path, od, dest, framework, dtype, facts, counts))
    return ExportResult(str(dest), counts[0], counts[1], dtype, str(dest / MANIFEST))


def _write_items(manifest: Path, od: OutDir, dest: Path, framework: str, dtype: str | None, facts: dict[str, Any],
                 counts: list[int]) -> None:
    """Each image's and video clip's token embedding as a file in `dest`, and its line in `manifest`."""
    from .output.embeddings import iter_token_embeddings

    with open(manifest, "w", encoding="utf-8") as fh:
        for emb in iter_token_embeddings(od, modality=None, framework=framework):
            if emb.modality not in ("image", "video"):
                continue
            if emb.grid is None:
                raise OutputError(f"{emb.id}: the index holds no {emb.modality}_grid_thw")
            name = export_filename(emb.id, emb.modality)
            seconds = _second_per_grid(emb, facts)
            _write_item(dest / name, emb.array, emb.grid, framework, emb.modality, seconds)
            row = {"id": emb.id, "modality": emb.modality, "file": name, "tokens": int(emb.array.shape[0]),
                   "dim": int(emb.array.shape[1]), "dtype": dtype, f"{emb.modality}_grid_thw": list(emb.grid),
                   "orig_width": emb.info.get("orig_width"), "orig_height": emb.info.get("orig_height")}
            if seconds is not None:
                row["second_per_grid_ts"] = seconds
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            counts[0] += 1
            counts[1] += row["tokens"]


def _prepare_dest(dest: Path, overwrite: bool) -> None:
    if dest.exists() and not dest.is_dir():
        raise OutputError(f"{dest} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()):
        previous = dest / MANIFEST
        if not previous.exists():
            raise OutputError(f"{dest} is not empty and holds no earlier export ({MANIFEST}); choose an empty folder")
        if not overwrite:
            raise OutputError(f"{dest} holds an earlier export; pass --overwrite to replace it")
        for line in previous.read_text(encoding="utf-8").splitlines():
            if line.strip():
                (dest / Path(json.loads(line)["file"]).name).unlink(missing_ok=True)
        previous.unlink()
    dest.mkdir(parents=True, exist_ok=True)


def _second_per_grid(emb: Any, facts: dict[str, Any]) -> float | None:
    """A video clip's seconds per temporal patch (temporal_patch_size x the seconds between its
    sampled frames): Qwen2.5-VL's `second_per_grid_ts`; None for images and older outputs."""
    step, temporal = emb.info.get("frame_seconds"), facts.get("temporal_patch_size")
    if emb.modality != "video" or step is None or not temporal or facts.get("model_type") != "qwen2_5_vl":
        return None
    return float(temporal) * float(step)


def _write_item(path: Path, array: Any, grid: tuple[int, int, int], framework: str, modality: str,
                seconds: float | None = None) -> None:
    """Write one item's tensors (`image_...` or `video_...`, and a clip's `second_per_grid_ts`),
    whole or not at all (the output's one atomic write)."""
    import numpy as np

    meta = {"format": f"vllm-{modality}-embeds", "producer": "mmenc"}
    extra = {f"{modality}_grid_thw": np.asarray([grid], dtype=np.int64)}
    if seconds is not None:
        extra["second_per_grid_ts"] = np.asarray([seconds], dtype=np.float32)

    def save(tmp: Path) -> None:
        if framework == "pt":
            import torch
            from safetensors.torch import save_file as save_torch

            tensors = {f"{modality}_embeds": array.contiguous(), **{k: torch.from_numpy(v) for k, v in extra.items()}}
            save_torch(tensors, str(tmp), metadata=meta)
        else:
            from safetensors.numpy import save_file

            save_file({f"{modality}_embeds": np.ascontiguousarray(array), **extra}, str(tmp), metadata=meta)

    LOCAL.publish(path, save)


__all__ = ["ExportResult", "export_filename", "export_vllm"]
