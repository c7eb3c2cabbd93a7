"""A deterministic fake encoder for tests where the model does not matter.

Vectors are a hash of the payload (so a clean run and a resumed run agree exactly), it counts
its batches, and it can be told to fail: for one chosen payload, above a batch size (as an
out-of-memory error), or by returning the wrong number of outputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

from mmenc_cli.encoders.base import EncodeOutput, Encoder, ImageInput, ImagePreprocessor


class FakeOOM(RuntimeError):
    """Looks like torch's CUDA OOM to mmenc (the message is what `errors._is_oom` matches)."""

    def __init__(self, n: int) -> None:
        super().__init__(f"CUDA out of memory. Tried to allocate a batch of {n}")


@dataclass
class FakePreprocessor(ImagePreprocessor):
    """Worker side: a 4x4 uint8 thumbnail (picklable, torch-free)."""

    def __call__(self, image: Image.Image) -> ImageInput:
        return ImageInput(np.asarray(image.convert("RGB").resize((4, 4)), dtype=np.uint8), {"orig_size": image.size})


def _vec(data: bytes, dim: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(data).digest()[:8], "little")
    return np.random.default_rng(seed).standard_normal(dim).astype(np.float32)


@dataclass
class FakeEncoder(Encoder):
    """Encodes images and texts deterministically; records every batch it was given."""

    dim: int = 8
    modalities: frozenset = frozenset({"image", "text"})
    default_normalize: bool = False
    output_kind: str = "pooled"
    fail_on: Callable[[str, Any], bool] | None = None  # raise when a batch holds such a payload
    oom_above: int | None = None  # raise an OOM for batches larger than this
    oom_on: Callable[[str, Any], bool] | None = None  # OOM whenever a batch holds such a payload
    nan_on: Callable[[str, Any], bool] | None = None  # return NaN for such payloads
    drop_output: Callable[[str, Sequence[Any]], bool] | None = None  # return one output too few
    batches: list[tuple[str, int]] = field(default_factory=list)
    info: dict = field(default_factory=lambda: {"family": "fake", "revision": "fake-1"})
    device: str = "cpu"

    def image_preprocessor(self) -> FakePreprocessor:
        return FakePreprocessor()

    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        import torch

        self.batches.append((modality, len(payloads)))
        if self.oom_above is not None and len(payloads) > self.oom_above:
            raise FakeOOM(len(payloads))
        if self.oom_on and any(self.oom_on(modality, p) for p in payloads):
            raise FakeOOM(len(payloads))
        if self.fail_on and any(self.fail_on(modality, p) for p in payloads):
            raise ValueError("fake encoder failure on a chosen item")
        rows = []
        for p in payloads:
            data = p.encode() if modality == "text" else p.pixels.tobytes()
            v = _vec(data, self.dim)
            if self.nan_on and self.nan_on(modality, p):
                v[0] = np.nan
            rows.append(v)
        if self.drop_output and self.drop_output(modality, payloads):
            rows = rows[:-1]
        return EncodeOutput(torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, self.dim)),
                            [False] * len(payloads) if modality == "text" else [])


def factory(encoder: FakeEncoder) -> Callable[..., FakeEncoder]:
    """An `encoder_factory` for `run_encode` that always returns `encoder`."""
    return lambda cfg, device=None: encoder


def fake_cuda_streams(monkeypatch: Any, log: list[str], faults: list[BaseException] | None = None) -> None:
    """Replace torch's CUDA stream API with one that logs, in order: entering and leaving a stream
    ("on side", "off side"), waits ("current waits for side", "current waits for the event on
    side"), events ("event on side"), synchronizing a stream ("side synchronized": raises the first
    of `faults` left, as a lost context does), `record_stream` ("used on current") and making a
    device current ("device 1"). Each thread's current stream is "current" until it enters another
    (as CUDA's current stream is per thread); every new stream is "side"."""
    import threading

    import torch

    local = threading.local()

    class FakeStream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: "FakeStream") -> None:
            log.append(f"{self.name} waits for {other.name}")

        def wait_event(self, event: "FakeEvent") -> None:
            log.append(f"{self.name} waits for {event.name}")

        def synchronize(self) -> None:
            log.append(f"{self.name} synchronized")
            if faults:
                raise faults.pop(0)

    class FakeEvent:
        def __init__(self, *a: Any, **k: Any) -> None:
            self.name = "an unrecorded event"

        def record(self, stream: FakeStream | None = None) -> None:
            where = (stream or current_stream()).name
            self.name = f"the event on {where}"
            log.append(f"event on {where}")

    class On:
        def __init__(self, stream: FakeStream) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            log.append(f"on {self.stream.name}")
            local.__dict__.setdefault("stack", []).append(self.stream)

        def __exit__(self, *exc: Any) -> None:
            local.stack.pop()
            log.append(f"off {self.stream.name}")

    current = FakeStream("current")

    def current_stream(device: Any = None) -> FakeStream:
        stack = local.__dict__.get("stack")
        return stack[-1] if stack else current

    monkeypatch.setattr("mmenc_cli.encoders.device._SIDE_STREAMS", {})  # no stream kept from before
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("side"))
    monkeypatch.setattr(torch.cuda, "stream", On)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: log.append(f"device {torch.device(device).index}"))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(f"used on {s.name}"),
                        raising=False)
