"""The small interface every model adapter implements, and what crosses process boundaries.

The pipeline never sees model internals. Per modality it needs:

* for images, a picklable `ImagePreprocessor` that turns a decoded RGB PIL image into a compact
  `ImageInput` inside a worker process (uint8 pixels where the processor allows), and
* for audio, a picklable `AudioPreprocessor` that turns mono samples at its rate into an
  `AudioInput` (the model's feature extractor, in the worker);
* for video, the image preprocessor applied to each sampled frame: a `VideoInput` of frames;
* an `Encoder.encode(modality, payloads)` that takes a list of `ImageInput` (images),
  `AudioInput`, `VideoInput` or `str` (texts, prefix already applied) and returns one float32
  vector per payload (pooled modes) or one `[tokens, dim]` tensor per payload (`--pooling tokens`).

`encode` is called on any sub-list of a batch: the batching stage bisects failed batches. Every
capability the run uses is declared on `Encoder`, the base class all adapters derive from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..errors import MMError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from PIL import Image


@dataclass(slots=True)
class ImageInput:
    """What a worker ships to the encode loop for one image.

    `pixels` is uint8 (resized/cropped, not yet rescaled or normalized) where the model's
    processor allows it, else float32 model input. `meta` carries per-image facts the encoder or
    the writer needs (e.g. `image_grid_thw`, `orig_size`).
    """

    pixels: "np.ndarray"
    meta: dict[str, Any] = field(default_factory=dict)


#: `Image.info` key of a JPEG decoded at a reduced scale: ((width, height) of the full upright image,
#: the box of the reduced image that it covers). The reduced size rounds up to whole pixels, so the
#: resize's target comes from the full size and the resize takes the box (the full decode's geometry).
REDUCED = "mmenc_reduced"


class DecodeAhead(ABC):
    """One batch's JPEGs being decoded on the device (`DeviceDecoder.start`)."""

    #: seconds the decode of this batch took on its thread (known once `wait` returned)
    seconds: float = 0.0

    @abstractmethod
    def done(self) -> bool:
        """True once `wait` would not block."""

    @abstractmethod
    def wait(self) -> list[ImageInput | None]:
        """Each payload decoded and preprocessed on the device (one not a JPEG: as it was), or None
        where the device refused it (the workers decode it then); ready for the next forward of
        the calling thread. A sticky device error raises `DeviceError`."""


class DeviceDecoder(ABC):
    """`--decode gpu`: decodes the JPEG payloads of a batch (`meta["jpeg"]`, encoded bytes) on the
    model's device and preprocesses them there, off the calling thread, so the next batch decodes
    while the current one's forward runs."""

    @abstractmethod
    def start(self, payloads: list[ImageInput]) -> DecodeAhead:
        """Begin decoding `payloads`; batches are decoded in the order they are started."""

    def __call__(self, payloads: list[ImageInput]) -> list[ImageInput | None]:
        """Decode `payloads` and wait for them."""
        return self.start(payloads).wait()

    def close(self) -> None:
        """Stop the decoding thread (after what was started is done)."""


class ImagePreprocessor(ABC):
    """Runs in worker processes: RGB PIL image -> `ImageInput`. Must be picklable, hold no tensors."""

    @abstractmethod
    def __call__(self, image: "Image.Image") -> ImageInput: ...

    def draft_size(self, width: int, height: int) -> tuple[int, int] | None:
        """(width, height) to decode a JPEG of an upright image this size at, when it may be decoded
        at a reduced scale (`--decode fast`); None: decode in full (the default)."""
        return None

    def for_fast_decode(self) -> "ImagePreprocessor":
        """This preprocessor under `--decode fast`: faster, pixels close to (not the same as) its
        own (default: itself)."""
        return self

    def imports_torch(self) -> bool:
        """True when calling it imports torch (decode workers then preload it, one thread each)."""
        return False

    def max_pixel_bytes(self) -> int | None:
        """An upper bound of one image's uint8 `pixels` in bytes, when there is one: the decode
        workers then hand pixels over in shared memory. None: sizes vary (pickled)."""
        return None


@dataclass(slots=True)
class AudioInput:
    """What a worker ships for one audio clip: the model's input features for it (the feature
    extractor's arrays without the batch axis, e.g. CLAP's `input_features` and `is_longer`);
    `meta["cut"]` when the clip was longer than the limit and cut."""

    features: dict[str, "np.ndarray"]
    meta: dict[str, Any] = field(default_factory=dict)


class AudioPreprocessor(ABC):
    """Runs in worker processes: mono float32 samples at `sample_rate` -> `AudioInput`. Picklable.

    `window_seconds`: the longest clip the model takes in one window (None: no limit); longer
    clips are cut to it before they get here, so the feature extractor never crops at random."""

    sample_rate: int
    window_seconds: float | None = None

    @abstractmethod
    def __call__(self, samples: "np.ndarray") -> AudioInput: ...


@dataclass(slots=True)
class VideoInput:
    """What a worker ships for one video clip: each sampled frame preprocessed as an image;
    `meta["cut"]` when the clip was longer than --max-video-seconds."""

    frames: list[ImageInput]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EncodeOutput:
    """The result of encoding one sub-batch.

    `vectors`: float32 tensor `[n, dim]` (pooled), or a list of `[tokens_i, dim]` tensors (tokens).
    `truncated`: per text, whether tokenization cut it (empty for images).
    """

    vectors: "torch.Tensor | list[torch.Tensor]"
    truncated: list[bool] = field(default_factory=list)


class Encoder(ABC):
    """A loaded model adapter, loaded once per run (per device): what the run code may use.

    Required: the attributes below, `image_preprocessor` (when images are offered) and `encode`.
    Optional capabilities have defaults here that mean "not offered"; an adapter overrides the
    ones it has. The run code calls nothing else.
    """

    #: modalities this model can encode: a subset of {"image", "text", "audio", "video"}
    modalities: frozenset[str]
    #: embedding dimension
    dim: int
    #: the model's own convention for normalizing (ST `Normalize` module, CLIP/SigLIP: True)
    default_normalize: bool
    #: facts recorded in the run metadata: model id, resolved revision, family, pooling, max_length...
    info: dict[str, Any]
    #: "pooled" (one vector per item) or "tokens" (one [tokens, dim] tensor per item)
    output_kind: str = "pooled"
    #: token outputs whose rows are embeddings in their own right (`--pooling frames`): the run
    #: normalizes each row when normalizing is on (pooled vectors are always normalizable)
    normalizes_rows: bool = False
    #: where the model runs: "cpu", "cuda", "cuda:1", "mps"
    device: str = "cpu"
    #: texts longer than this many characters are cut before tokenizing (None: no cut)
    max_text_chars: int | None = None

    @abstractmethod
    def image_preprocessor(self) -> ImagePreprocessor:
        """A picklable callable for worker processes (raise when images are not offered)."""

    def video_preprocessor(self) -> Callable[[list["Image.Image"]], Any] | None:
        """A picklable callable for the workers turning a clip's sampled RGB frames into one payload
        (e.g. a VL model's own video processor); None: each frame goes through the image
        preprocessor and the payload is a `VideoInput` (the pooled families' mean of frames)."""
        return None

    def audio_preprocessor(self) -> AudioPreprocessor:
        """A picklable callable for worker processes (raise when audio is not offered)."""
        raise ValueError(f"{self.info.get('model')}: this model does not encode audio")

    @abstractmethod
    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        """Encode a non-empty list of payloads of one modality under `torch.inference_mode()`:
        `ImageInput`s, `AudioInput`s, `VideoInput`s, or texts (strings, or what
        `text_pretokenizer` made of them)."""

    def check_outputs(self, modality: str, payloads: Sequence[Any],
                      vectors: Sequence["np.ndarray"]) -> list[MMError | None] | None:
        """Per item, an error when its output breaks what preprocessing promised (e.g. a token
        count); None when the adapter makes no such check."""
        return None

    def text_pretokenizer(self, other_thread: bool) -> Callable[[Sequence[str]], list[Any]] | None:
        """A function tokenizing texts without padding, whose results `encode` takes in place of
        the strings (the run sorts a window of texts by their token counts, so batches only pad);
        for another thread than `encode`'s when `other_thread`. None: `encode` takes strings only."""
        return None

    def use_early_tokens(self, early: Any) -> bool:
        """Take texts' tokens from `early` (an `early_table.EarlySource`) where it has them; False
        where this encoder never will (only encoders that tokenize with a fast tokenizer do)."""
        return False

    def device_seconds(self) -> float | None:
        """Seconds the accelerator spent in forward passes so far; None where not measured."""
        return None

    def image_device_decoder(self) -> "DeviceDecoder | None":
        """`--decode gpu`: a `DeviceDecoder` for this model's images; None: this model's
        preprocessing cannot run on the device."""
        return None

    def default_batch_size(self, modalities: Sequence[str]) -> int | None:
        """The batch size for a run of `modalities` when `--batch-size` is not given, chosen for
        this model on its device (on CUDA by a short probe of forwards); None: no choice of its own
        (`config.DEFAULT_BATCH_SIZE` holds)."""
        return None

    def forward_summary(self) -> dict[str, Any] | None:
        """How the forward ran (the CPU path: streams, linears, probes), for the task metadata."""
        return None
