"""Qwen2-VL / Qwen2.5-VL vision towers: token-level (`--pooling tokens`) or mean-pooled image embeddings.

Only the vision tower is built and loaded: its class comes from the checkpoint's
`config.vision_config`, and only the `visual.*` tensors (transformers 5 and the original Qwen
checkpoints) or `model.visual.*` tensors (checkpoints saved by transformers 4.5x) are read from
the safetensors file(s) with `safe_open`; the language model's weights are never read. A model
folder needs its config, weights and image processor; a tokenizer is not used.

Images cross processes as uint8 patches with their grids (`qwen_vl_preprocess.py`). On the device
a 3 x 256 lookup table (the processor's own float32 arithmetic) normalizes them and the temporal
copy is a broadcast, so `pixel_values` equal the processor's bit for bit. The encoder checks that
the tower produced exactly those tokens for every image (`check_outputs`: 500
`encode.token_mismatch` "Encoder produced N tokens, but preprocessing expected M"), and raises
inside `encode` when the grids do not match the images sent or the outputs do not match the
batch, so the batching stage bisects down to the guilty items and nothing is ever shifted.
"""

from __future__ import annotations

import importlib
import json
import logging
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import MMError, ModelLoadError
from .base import EncodeOutput, Encoder, ImageInput
from .device import resolve_dtype, to_device
from .loading import ModelProbe, fetch_file, load_part
from .qwen_vl_preprocess import QwenVideoPreprocessor, plan_preprocessor

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

log = logging.getLogger("mmenc")

#: model_type -> (module, vision tower class) in transformers
TOWERS: dict[str, tuple[str, str]] = {
    "qwen2_vl": ("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionTransformerPretrainedModel"),
}


#: where checkpoints keep the vision tower: transformers 5 saves (and Qwen's originals) use `visual.`,
#: transformers 4.5x saves `model.visual.`
VISUAL_PREFIXES = ("visual.", "model.visual.")


def token_mismatch(produced: int, expected: int) -> MMError:
    """The one error for an item whose token count differs from what preprocessing promised."""
    return MMError(f"Encoder produced {produced} tokens, but preprocessing expected {expected}",
                   stage="encode", reason="encode.token_mismatch")


def _images(n: int) -> str:
    return f"{n} image" if n == 1 else f"{n} images"


class QwenVLEncoder(Encoder):
    """A Qwen2-VL / Qwen2.5-VL vision tower behind the `Encoder` protocol: images, and video clips
    when the model has a video processor (the same tower on temporal patches of their frames).

    `pooling="tokens"`: `output_kind` "tokens", one float32 `[tokens_i, dim]` tensor per image.
    `pooling="mean"`: `output_kind` "pooled", the mean of each image's tokens.
    `dim` is the merger's output size (the language model's hidden size).

    `_prepare` (payloads -> pixel_values, grid_thw) and `tower` (pixel_values, grid_thw ->
    merged tokens, one tensor or one per image) are the seams tests use to inject faults.
    """

    family = "qwen2-vl"
    modalities = frozenset({"image"})
    default_normalize = False

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, visual: Any, processor: Any, *,
                 pooling: str, weights: dict[str, Any] | None = None, video_processor: Any = None) -> None:
        import torch

        if pooling not in ("tokens", "mean"):
            raise ModelLoadError(f"--pooling {pooling} is not supported for Qwen2-VL towers (tokens, mean)")
        self.visual, self.device, self.pooling = visual, device, pooling
        self.output_kind = "tokens" if pooling == "tokens" else "pooled"
        self.dtype = next(visual.parameters()).dtype
        self._prep, table = plan_preprocessor(processor, visual.config)
        plan = self._prep if table is not None else self._prep.plan
        self.merge = plan.merge_size
        self._video = None if video_processor is None else QwenVideoPreprocessor(video_processor, plan.merge_size)
        self.modalities = frozenset({"image", "video"} if self._video is not None else {"image"})
        self._patch, self._temporal = plan.patch_size, plan.temporal_patch_size
        self._table = None
        if table is not None:
            self._table = torch.from_numpy(table).reshape(-1).to(device)
            per_channel = plan.patch_size * plan.patch_size
            cols = torch.arange(3 * per_channel, dtype=torch.int32, device=device)
            self._col_offsets = ((cols // per_channel) * 256).view(1, -1)
        self.info: dict[str, Any] = {
            "model": cfg.model, "revision": cfg.revision, "commit": probe.commit, "family": self.family,
            "model_type": probe.model_type, "pooling": pooling, "device": device,
            "dtype": str(self.dtype).removeprefix("torch."),
            "image_input": "uint8-patches" if table is not None else "float32-patches",
            "min_pixels": plan.min_pixels, "max_pixels": plan.max_pixels, "patch_size": plan.patch_size,
            "merge_size": plan.merge_size, "temporal_patch_size": plan.temporal_patch_size,
            "default_normalize": False, "compile": False, "weights": dict(weights or {}),
            "video_input": None if self._video is None else "float32-patches",
        }
        if cfg.compile:
            log.warning("--compile is not used for Qwen2-VL towers (every batch has another shape)")
        self.dim = self._probe_dim()

    # -- Encoder protocol

    def image_preprocessor(self) -> Any:
        """The picklable worker-side preprocessor (torch-free on the uint8 path)."""
        return self._prep

    def video_preprocessor(self) -> Any:
        """The model's own video processor for a clip's sampled frames (in the workers)."""
        return self._video

    def encode(self, modality: str, payloads: Sequence[ImageInput]) -> EncodeOutput:
        """Encode images or video clips: one float32 `[tokens, dim]` tensor each (tokens) or `[n, dim]` (mean).

        Raises (so the batch is bisected) when preprocessing's grids do not match the images, or
        the tower's outputs do not match the batch; an `MMError` raised for a single image is
        that image's error.
        """
        import torch

        if modality not in self.modalities:
            raise ValueError(f"this Qwen2-VL vision tower does not encode {modality!r}")
        n = len(payloads)
        with torch.inference_mode():
            pixel_values, grid = self._prepare(payloads)
            if int(grid.shape[0]) != n:
                raise MMError(f"preprocessing produced {int(grid.shape[0])} image grids for {_images(n)}",
                              stage="encode", reason="preprocess.failed")
            expected = (grid.prod(-1) // self.merge ** 2).tolist()
            per_image = self._split(self.tower(pixel_values, grid), expected)
            if self.output_kind == "tokens":
                return EncodeOutput([t.float() for t in per_image])
            for got, want in zip(per_image, expected):
                if int(got.shape[0]) != want:
                    if n == 1:
                        raise token_mismatch(int(got.shape[0]), want)
                    raise MMError(f"a batch of {_images(n)} has a token-count mismatch", stage="encode",
                                  reason="encode.token_mismatch")
            return EncodeOutput(torch.stack([t.float().mean(dim=0) for t in per_image]))

    def check_outputs(self, modality: str, payloads: Sequence[ImageInput],
                      vectors: Sequence[np.ndarray]) -> list[MMError | None]:
        """Per image: its token rows must equal t*h*w / merge^2 from preprocessing, its width `dim`."""
        errors: list[MMError | None] = []
        for payload, vec in zip(payloads, vectors):
            err = None
            if vec.ndim == 2:
                expected = int(payload.meta["tokens"])
                if vec.shape[0] != expected:
                    err = token_mismatch(int(vec.shape[0]), expected)
                elif vec.shape[1] != self.dim:
                    err = MMError(f"Encoder produced {vec.shape[1]}-dim tokens, expected {self.dim}",
                                  stage="encode", reason="encode.failed")
            errors.append(err)
        return errors

    # -- internals

    def tower(self, pixel_values: "torch.Tensor", grid: "torch.Tensor") -> Any:
        """The vision tower's merged tokens for a batch: `[sum(tokens_i), dim]`."""
        import torch

        out = self.visual(pixel_values, grid_thw=grid)
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    def _prepare(self, payloads: Sequence[ImageInput]) -> tuple["torch.Tensor", "torch.Tensor"]:
        """The batch's `pixel_values` `[sum(t*h*w), C*T*p*p]` (model dtype) and `grid_thw` `[n, 3]`."""
        import torch

        grids = [p.meta.get("image_grid_thw") or p.meta["video_grid_thw"] for p in payloads]
        flat = np.concatenate([p.pixels for p in payloads]) if payloads else np.zeros((0, 0), np.uint8)
        pixels = to_device(torch.from_numpy(flat), self.device)
        if pixels.dtype == torch.uint8:
            # exact: the table holds the processor's own float32 result for each (channel, value)
            assert self._table is not None
            p = self._patch
            pixels = self._table[pixels.int() + self._col_offsets]
            pixels = pixels.view(-1, 3, 1, p, p).expand(-1, 3, self._temporal, p, p).reshape(pixels.shape[0], -1)
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3).to(self.device)
        if int(pixels.shape[0]) != int(grid.prod(-1).sum()):
            raise MMError(f"preprocessing produced {int(pixels.shape[0])} patches, its grids "
                          f"{int(grid.prod(-1).sum())}", stage="encode", reason="preprocess.failed")
        return pixels.to(self.dtype), grid

    def _split(self, out: Any, expected: list[int]) -> list["torch.Tensor"]:
        """One tensor per image; raises (bisect) when the outputs cannot be attributed to images."""
        import torch

        n = len(expected)
        if isinstance(out, (list, tuple)):
            if len(out) != n:
                raise MMError(f"the vision tower returned {len(out)} outputs for {_images(n)}", stage="encode",
                              reason="encode.output_count")
            return list(out)
        total = int(out.shape[0])
        if total == sum(expected):
            return list(torch.split(out, expected))
        if n == 1:
            return [out]  # `check_outputs` / the mean path report this image's mismatch
        raise MMError(f"the vision tower returned {total} tokens for {_images(n)}; preprocessing expected "
                      f"{sum(expected)}", stage="encode", reason="encode.token_mismatch")

    def _probe_dim(self) -> int:
        """Encode one dummy image: fixes `dim` and fails at startup, not at batch one."""
        from PIL import Image

        dummy = self._prep(Image.new("RGB", (56, 56), (120, 90, 60)))
        try:
            vectors = self.encode("image", [dummy]).vectors
        except Exception as exc:
            raise ModelLoadError(f"{self.info['model']}: a test image encode failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        first = vectors[0]
        self.dim = int(first.shape[-1])
        errors = self.check_outputs("image", [dummy], [first.cpu().numpy()])
        if errors[0] is not None:
            raise ModelLoadError(f"{self.info['model']}: test image: {errors[0].message}")
        return self.dim


def _weight_files(probe: ModelProbe, cfg: "ModelConfig") -> list[str]:
    """The safetensors file(s) holding the vision tower (only those shards of a sharded checkpoint)."""
    index = fetch_file(probe.source, "model.safetensors.index.json", cfg.revision)
    if index is not None:
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        names = sorted({f for k, f in weight_map.items() if k.startswith(VISUAL_PREFIXES)})
        if not names:
            raise ModelLoadError(f"{probe.source}: the checkpoint index lists no vision tower weights "
                                 f"({' or '.join(p + '*' for p in VISUAL_PREFIXES)})")
    else:
        names = ["model.safetensors"]
    files = []
    for name in names:
        path = fetch_file(probe.source, name, cfg.revision)
        if path is None:
            raise ModelLoadError(f"{probe.source}: no {name} (mmenc loads Qwen2-VL towers from safetensors only)")
        files.append(str(path))
    return files


def read_visual_state(files: Sequence[str]) -> tuple[dict[str, Any], str]:
    """The vision tower's tensors (prefix stripped) from safetensors files, and the prefix used.

    Only keys under `visual.` or `model.visual.` are read; both prefixes at once is an error.
    """
    from safetensors import safe_open

    state: dict[str, Any] = {}
    prefixes: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as fh:
            for key in fh.keys():
                prefix = next((p for p in VISUAL_PREFIXES if key.startswith(p)), None)
                if prefix is None:
                    continue
                prefixes.add(prefix)
                state[key[len(prefix):]] = fh.get_tensor(key)
    if len(prefixes) > 1:
        raise ModelLoadError(f"the checkpoint holds the vision tower twice ({', '.join(sorted(prefixes))})")
    if not state:
        raise ModelLoadError(f"no vision tower weights ({' or '.join(p + '*' for p in VISUAL_PREFIXES)}) "
                             f"in {', '.join(files)}")
    return state, prefixes.pop()


def build_tower(model_type: str, vision_config: Any, dtype: "torch.dtype") -> Any:
    """The vision tower module for `model_type`, in `dtype`, without random initialization."""
    import contextlib

    module, name = TOWERS[model_type]
    cls = getattr(importlib.import_module(module), name)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        no_init_weights = contextlib.nullcontext  # type: ignore[assignment]
    with no_init_weights():
        try:
            return cls._from_config(vision_config, dtype=dtype)
        except TypeError:  # pragma: no cover - transformers 4 names it torch_dtype
            return cls._from_config(vision_config, torch_dtype=dtype)


def load_vision_tower(probe: ModelProbe, cfg: "ModelConfig", dtype: "torch.dtype") -> tuple[Any, dict[str, Any]]:
    """Build the tower from `config.vision_config` and load only its weights; (module, facts)."""
    vision_config = getattr(probe.config, "vision_config", None)
    if vision_config is None or probe.model_type not in TOWERS:
        raise ModelLoadError(f"{probe.source}: not a Qwen2-VL / Qwen2.5-VL config")
    files = _weight_files(probe, cfg)
    state, prefix = read_visual_state(files)
    visual = build_tower(probe.model_type, vision_config, dtype)
    expected = set(visual.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"{probe.source}: vision tower weights missing from the checkpoint: "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(state) - expected)
    if unexpected:
        log.warning("%s: %d checkpoint tensor(s) under %r not used by the tower: %s", probe.source,
                    len(unexpected), prefix, ", ".join(unexpected[:5]))
    visual.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=True)
    return visual.eval(), {"prefix": prefix, "tensors": len(expected), "files": len(files)}


def load(probe: ModelProbe, cfg: "ModelConfig", device: str) -> QwenVLEncoder:
    """Family loader: the vision tower only, in `--dtype` on `device`, plus the image processor."""
    processor, why = load_part("image", probe, cfg)
    if processor is None:
        raise ModelLoadError(f"{probe.source}: {why}")
    video, _ = load_part("video", probe, cfg)  # none: images only
    visual, weights = load_vision_tower(probe, cfg, resolve_dtype(cfg.dtype, device))
    return QwenVLEncoder(probe, cfg, device, visual.to(device), processor, pooling=cfg.pooling, weights=weights,
                         video_processor=video)
