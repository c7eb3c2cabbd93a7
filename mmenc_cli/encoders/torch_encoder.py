"""The body every PyTorch-module adapter shares (`TorchEncoder`): transformers, OpenCLIP, timm.

It owns the model on its device and dtype, the batch forward (`cpu/`: one stream, or the CPU's
two streams with oneDNN's linears), turning worker `ImageInput`s into a device batch (uint8
pixels normalized through a lookup table where the image pipeline allows it), `torch.compile`
with an eager fallback, the one-item probe at load time that fixes `dim` and fails fast, and the
facts the run metadata records. A subclass says how texts become inputs (`tokenize`) and how
inputs become vectors (`_embed_image` / `_embed_text`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import ModelLoadError, first_line
from .base import AudioPreprocessor, DeviceDecoder, EncodeOutput, Encoder, ImageInput, ImagePreprocessor
from .cpu import make_forward
from .clip_batches import collate_audio, mean_of_frames
from .device import stack_to_device, to_device
from .forward import CompiledOrEager, Inputs
from .loading import ModelProbe

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig
    from .preprocess import PixelPreprocessor

#: how images cross processes: the worker-side preprocessor and, for uint8 pixels, the
#: [3, 256] float32 table of what the pipeline's rescale + normalize make of each value
ImagePlan = tuple[ImagePreprocessor, "np.ndarray | None"]

#: words of the batch-size probe's dummy text: a caption's or a sentence's length in tokens
PROBE_TOKENS = 64


class TorchEncoder(Encoder):
    """Shared body of the adapters around one `torch.nn.Module`.

    Subclasses set `family`, `towers` (the modalities they embed) and `library`, implement
    `_embed_image(inputs)`, `_embed_text(inputs)` and/or `_embed_audio(inputs)` returning
    `[n, dim]` tensors, and `tokenize(texts)` for text; a modality is offered when its tower
    exists and its image plan, tokenizer or audio preprocessor is there. A model that embeds
    images also embeds video: the mean of its sampled frames' embeddings (`clips.py`).
    Everything a subclass needs for `tokenize` is set before this __init__.
    """

    family = "torch"
    towers: frozenset[str] = frozenset()
    #: the library that builds the model, recorded with its version in the run metadata
    library = "transformers"

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 images: ImagePlan | None, text: bool, default_normalize: bool, pooling: str,
                 max_length: int | None = None, unavailable: dict[str, str] | None = None,
                 audio: AudioPreprocessor | None = None) -> None:
        self.model, self.device = model, device
        self.dtype = next(model.parameters()).dtype
        self.forward = make_forward(cfg.cpu_forward, model, device, cfg.compile)
        self.default_normalize = default_normalize
        self.max_length = max_length
        self._prep: ImagePreprocessor | None = None
        self._table = None
        if images is not None:
            self._use_images(*images)
        self._audio = audio
        offered = {"image": self._prep is not None, "text": text, "audio": audio is not None}
        embedded = {m for m in self.towers if offered[m]}
        self.modalities = frozenset(embedded | ({"video"} if "image" in embedded else set()))
        if not self.modalities:
            reasons = "; ".join((unavailable or {}).values())
            raise ModelLoadError(f"{probe.source}: no usable modality ({reasons})")
        self.info: dict[str, Any] = self._facts(probe, cfg, pooling, unavailable)
        self._run: dict[str, Callable[[Inputs], "torch.Tensor"]] = {
            m: getattr(self, f"_embed_{m}") for m in embedded}
        self.dim = self._probe_dim()
        self._eager = dict(self._run)  # what the batch-size probe times (a compiled forward would compile per size)
        self._batch_probe: dict[str, Any] | None = None
        if cfg.compile:
            self._run = {m: CompiledOrEager(fn, f"{self.family} {m}") for m, fn in self._run.items()}

    def _use_images(self, prep: ImagePreprocessor, table: np.ndarray | None) -> None:
        """The worker-side preprocessor and, on the uint8 path, the normalization table."""
        import torch

        self._prep = prep
        if table is not None:
            self._table_np = table  # [3, 256] float32, for the CPU path
            self._table = torch.from_numpy(table).reshape(-1).to(self.device)
            self._offsets = (torch.arange(3, dtype=torch.int32, device=self.device) * 256).view(1, 3, 1, 1)

    def _facts(self, probe: ModelProbe, cfg: "ModelConfig", pooling: str,
               unavailable: dict[str, str] | None) -> dict[str, Any]:
        """What the run metadata records about this model and how it runs."""
        from importlib.metadata import PackageNotFoundError, version

        path = self.forward.summary()
        package = {"open_clip": "open_clip_torch"}.get(self.library, self.library)
        try:
            library_version = version(package)
        except PackageNotFoundError:  # pragma: no cover - a library imported from a source tree
            library_version = None
        return {
            "model": cfg.model, "revision": cfg.revision, "commit": probe.commit, "family": self.family,
            "library": self.library, "library_version": library_version,
            "model_type": probe.model_type, "pooling": pooling, "max_length": self.max_length,
            "device": self.device, "dtype": str(self.dtype).removeprefix("torch."),
            "image_input": None if self._prep is None else "uint8" if self._table is not None else "float32",
            "default_normalize": self.default_normalize, "compile": cfg.compile,
            "cpu_linear": _cpu_linear(path), "cpu_streams": path["streams"],
            "unavailable": dict(unavailable or {}),
        }

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        raise NotImplementedError

    def _embed_text(self, inputs: Inputs) -> "torch.Tensor":
        raise NotImplementedError

    def _embed_audio(self, inputs: Inputs) -> "torch.Tensor":
        raise NotImplementedError

    def tokenize(self, texts: Sequence[Any]) -> tuple[Inputs, list[bool]]:
        """Texts as model inputs on the device, and which texts the model's limit cut."""
        raise NotImplementedError

    # -- Encoder

    def image_preprocessor(self) -> ImagePreprocessor:
        """The picklable worker-side preprocessor (torch-free on the uint8 path)."""
        if self._prep is None:
            raise ValueError(f"{self.info['model']}: this model does not encode images")
        return self._prep

    def audio_preprocessor(self) -> AudioPreprocessor:
        """The picklable worker-side feature extractor of audio clips."""
        if self._audio is None:
            raise ValueError(f"{self.info['model']}: this model does not encode audio")
        return self._audio

    def image_device_decoder(self) -> "DeviceDecoder | None":
        """`--decode gpu` for the uint8 resize-and-crop path (CLIP, SigLIP, ViT, OpenCLIP, timm);
        None for a processor that runs whole in the workers."""
        from .device_decode import DeviceJpegDecoder

        prep = self.device_pixels()
        return None if prep is None else DeviceJpegDecoder(prep, self.device)

    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        """Encode images (`ImageInput`s), audio (`AudioInput`s), video (`VideoInput`s: the mean of
        the frames' image embeddings) or texts; float32 vectors, left on the device."""
        if modality not in self.modalities:
            raise ValueError(f"this model does not encode {modality!r}")
        if modality == "video":
            return mean_of_frames(lambda frames: self.encode("image", frames), payloads)
        vectors, truncated = self.forward.run(payloads, functools.partial(self._inputs, modality),
                                              self._run[modality])
        return EncodeOutput(vectors, truncated)

    def device_seconds(self) -> float | None:
        """Seconds the accelerator spent in forward passes so far (CUDA events), None on the CPU."""
        return self.forward.device_seconds()

    def forward_summary(self) -> dict[str, Any] | None:
        """How the forward ran: `--cpu-forward` asked, streams, linears, the probes' evidence; on
        CUDA without `--batch-size`, what the batch-size probe tried and chose."""
        summary = self.forward.summary()
        if self._batch_probe is not None:
            summary["batch_probe"] = self._batch_probe
        return summary

    def default_batch_size(self, modalities: Sequence[str]) -> int | None:
        """On CUDA, the batch-size probe's choice (`batch_probe.py`) for each asked modality whose
        dummy input stands for the real ones (fixed-size images, texts of `PROBE_TOKENS`, audio
        windows; video as its frames), the smallest of them; None elsewhere."""
        if not str(self.device).startswith("cuda"):
            return None
        from .batch_probe import cuda_device, probe_batch_size

        asked = {"image" if m == "video" else m for m in modalities} & set(self._eager)
        if self.device_pixels() is None:  # variable-sized images (a VL model's grids): no dummy stands for them
            asked.discard("image")
        if not asked:
            return None
        device = cuda_device(self.device)
        results = {m: probe_batch_size(self._probe_forward(m), device) for m in sorted(asked)}
        self._batch_probe = {m: r.to_dict() for m, r in results.items()}
        return min(r.chosen for r in results.values())

    def device_pixels(self) -> "PixelPreprocessor | None":
        """The worker-side preprocessor when images are fixed-size uint8 pixels resized and cropped
        (what `--decode gpu` and the batch-size probe take), else None."""
        from .preprocess import PixelPreprocessor

        return self._prep if self._table is not None and isinstance(self._prep, PixelPreprocessor) else None

    def _probe_forward(self, modality: str) -> Callable[[int], Any]:
        """`run(n)`: the eager forward of n copies of `modality`'s dummy input, inputs made as a
        batch's are."""
        import torch

        dummy, forward = self._dummy(modality, probe=True), self._eager[modality]

        def run(n: int) -> Any:
            with torch.inference_mode():
                return forward(self._inputs(modality, [dummy] * n)[0])

        return run

    def _inputs(self, modality: str, payloads: Sequence[Any]) -> tuple[Inputs, list[bool]]:
        if modality == "image":
            return self.collate_images(payloads), []
        if modality == "audio":
            return collate_audio(payloads, self.device, self.dtype), []
        return self.tokenize(payloads)

    def collate_images(self, items: Sequence[ImageInput]) -> Inputs:
        """Stack worker outputs into a device batch; uint8 pixels become normalized floats here."""
        import torch

        first = items[0].pixels
        if first.dtype == np.uint8 and self.device == "cpu" and first.ndim == 3 and first.shape[0] == 3:
            # exact: the table holds the pipeline's own float32 result for each (channel, value);
            # numpy's take on uint8 indices is ~3x faster than an int32 gather in torch on the CPU
            stacked = np.stack([it.pixels for it in items])
            out = np.empty(stacked.shape, dtype=np.float32)
            for c in range(3):
                np.take(self._table_np[c], stacked[:, c], out=out[:, c], mode="clip")
            pixels = torch.from_numpy(out)
        else:
            # on an accelerator the compact uint8 batch crosses the bus and is normalized there
            pixels = stack_to_device([it.pixels for it in items], self.device)
            if pixels.dtype == torch.uint8:
                pixels = self._table[pixels.int() + self._offsets]
        inputs = {"pixel_values": pixels.to(self.dtype)}
        for key in items[0].meta.get("inputs", {}):
            inputs[key] = to_device(torch.from_numpy(np.stack([it.meta["inputs"][key] for it in items])),
                                    self.device)
        return inputs

    def _probe_dim(self) -> int:
        """Encode one dummy item per modality: fixes `dim` and fails at startup, not at batch one."""
        dims = {}
        for modality in sorted(self._run):
            dummy = self._dummy(modality)
            try:
                vectors = self.encode(modality, [dummy]).vectors
            except ModelLoadError:
                raise
            except Exception as exc:
                raise ModelLoadError(f"{self.info['model']}: a test {modality} encode failed: "
                                     f"{type(exc).__name__}: {first_line(exc)}") from exc
            if vectors.ndim != 2 or vectors.shape[0] != 1:
                raise ModelLoadError(f"{self.info['model']}: {modality} output has shape "
                                     f"{tuple(vectors.shape)}, expected (1, dim)")
            dims[modality] = int(vectors.shape[1])
        if len(set(dims.values())) > 1:
            raise ModelLoadError(f"{self.info['model']}: the towers' dimensions differ: {dims}")
        return next(iter(dims.values()))

    def _dummy(self, modality: str, probe: bool = False) -> Any:
        """One dummy input of `modality`: a small image, a second of silence, a short text (for the
        batch-size probe, a text of `PROBE_TOKENS` words)."""
        from PIL import Image

        if modality == "image":
            return self._prep(Image.new("RGB", (48, 40), (120, 90, 60)))  # type: ignore[misc]
        if modality == "audio":
            return self._audio(np.zeros(self._audio.sample_rate, dtype=np.float32))  # type: ignore[misc]
        return " ".join(["x"] * PROBE_TOKENS) if probe else "mmenc"


def _cpu_linear(path: dict[str, Any]) -> str | None:
    """The run metadata's `cpu_linear`: None (PyTorch's own), "onednn" (pinned) or "auto"."""
    if path["evidence"] is None:
        return None
    return "onednn" if path["mode"] == "onednn" else "auto"
