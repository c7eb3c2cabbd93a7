"""Hugging Face model adapters: the shared machinery and the CLIP/SigLIP and vision-backbone families.

`HFEncoder` owns what every family needs: the model on its device and dtype, tokenizing with
honest truncation flags, turning worker `ImageInput`s into a device batch, `torch.compile` with an
eager fallback, and a one-item probe at load time that fixes `dim` and fails fast. A family
subclass only says how a batch becomes vectors (`_embed_image` / `_embed_text`).

Loading goes through transformers' Auto classes (`load_model`, `load_part`), with
`trust_remote_code` and safetensors-only weights unless `allow_pickle_weights`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from . import ModelLoadError, ModelProbe, fetch_file
from .base import EncodeOutput, ImageInput, ImagePreprocessor
from .cpu_choice import PathChoice
from .device import resolve_dtype, to_device
from .images import plan_image_input

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..config import ModelConfig

log = logging.getLogger("mmenc")

_HUGE = 1_000_000  # tokenizers without a limit report int(1e30) as model_max_length
#: any of these means the model ships a tokenizer
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.txt", "vocab.json", "spiece.model",
                   "tokenizer.model", "sentencepiece.bpe.model")

Inputs = dict[str, "torch.Tensor"]


# ------------------------------------------------------------------------------------- loading


def hub_kwargs(probe: ModelProbe, cfg: "ModelConfig", subfolder: str = "") -> dict[str, Any]:
    """The keyword arguments every `from_pretrained` call of one model shares."""
    kwargs: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if subfolder:
        kwargs["subfolder"] = subfolder
    return kwargs


def load_model(probe: ModelProbe, cfg: "ModelConfig", device: str, dtype: "torch.dtype",
               subfolder: str = "") -> tuple[Any, set[str]]:
    """`AutoModel` in `dtype` on `device` in eval mode, plus the weight names the checkpoint lacked.

    Safetensors only unless `cfg.allow_pickle_weights` (then safetensors are still preferred:
    `use_safetensors=None`, since `False` would refuse a safetensors-only folder).
    """
    from transformers import AutoModel

    kwargs = hub_kwargs(probe, cfg, subfolder)
    kwargs.update(dtype=dtype, output_loading_info=True,
                  use_safetensors=None if cfg.allow_pickle_weights else True)
    try:
        model, loading = AutoModel.from_pretrained(probe.source, **kwargs)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... here
        message = _first_line(exc)
        if not cfg.allow_pickle_weights and "safetensors" in message:
            message += (" (mmenc loads only safetensors weights; if this model ships only pickle "
                        "weights such as pytorch_model.bin and you trust it, pass --allow-pickle-weights)")
        raise ModelLoadError(f"cannot load model {probe.source!r}: {message}") from exc
    missing = set(loading.get("missing_keys") or ())
    if missing:
        log.warning("%s: %d weight(s) missing from the checkpoint, randomly initialized: %s",
                    probe.source, len(missing), ", ".join(sorted(missing)[:5]))
    return model.to(device).eval(), missing


def load_part(kind: str, probe: ModelProbe, cfg: "ModelConfig",
              subfolder: str = "") -> tuple[Any, str | None]:
    """The model's tokenizer (`kind="text"`) or image processor (`kind="image"`), or (None, why).

    Image processors are loaded with the PIL backend: it is transformers' reference
    implementation, identical with or without torchvision, and the one the uint8 path reproduces.
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    kwargs = hub_kwargs(probe, cfg, subfolder)
    if kind == "text" and not any(fetch_file(probe.source, name, cfg.revision, subfolder)
                                  for name in TOKENIZER_FILES):
        # transformers 5 would build an empty-vocabulary tokenizer from the model type alone
        return None, "no tokenizer files"
    try:
        if kind == "text":
            return AutoTokenizer.from_pretrained(probe.source, **kwargs), None
        try:
            return AutoImageProcessor.from_pretrained(probe.source, backend="pil", **kwargs), None
        except TypeError:  # remote-code processors that do not take `backend`
            return AutoImageProcessor.from_pretrained(probe.source, **kwargs), None
    except Exception as exc:  # absent files or unusable processor: the modality is unavailable
        return None, f"no usable {'tokenizer' if kind == 'text' else 'image processor'}: {_first_line(exc)}"


def text_limit(tokenizer: Any, config: Any, declared: int | None, requested: int | None) -> int:
    """Token limit: the model's own (`declared`, else the tokenizer's if sane, else position
    embeddings), lowered by `--max-length` if given (it caps, never extends past the model)."""
    tok = getattr(tokenizer, "model_max_length", None)
    tok = tok if isinstance(tok, int) and 0 < tok < _HUGE else None
    positions = getattr(config, "max_position_embeddings", None)
    limit = declared or tok or positions or requested
    if limit is None:
        raise ModelLoadError("cannot tell the model's token limit; pass --max-length")
    if requested and requested > limit:
        log.warning("--max-length %d exceeds the model's limit of %d tokens; using %d",
                    requested, limit, limit)
    return min(limit, requested) if requested else limit


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def keep_accepted(fn: Callable[..., Any]) -> Callable[[Inputs], Inputs]:
    """A filter keeping only the inputs `fn` names: tokenizers return extras (token_type_ids) that
    some models' feature functions would reject."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if not names:  # a bare `forward(**kwargs)` (remote code): nothing to filter on
        return lambda inputs: inputs
    return lambda inputs: {k: v for k, v in inputs.items() if k in names}


def _units(inputs: Inputs) -> int:
    """A batch's size for timing: its token ids or pixels (padded), else 0 (not timed)."""
    for key in ("input_ids", "pixel_values"):
        if key in inputs:
            return int(inputs[key].numel())
    return 0


def _onednn_on(module: Any) -> bool:
    """Whether a patched layer or block takes oneDNN's path for the batch in flight (its model's
    `PathChoice` says; a layer not yet given one, during the load-time checks, does)."""
    choice = module.__dict__.get("_mmenc_path")
    return choice is None or choice.on


def cpu_path_choice(model: Any) -> PathChoice | None:
    """The `PathChoice` between oneDNN's and PyTorch's linears of a model `use_onednn_linears`
    switched, else None."""
    return model.__dict__.get("_mmenc_path")


def _onednn_linear(self: Any, x: "torch.Tensor") -> "torch.Tensor":
    """`nn.Linear.forward` through oneDNN, on the weight it packed at load (float32 CPU inputs),
    or PyTorch's own when its model's `PathChoice` says so."""
    import torch

    if x.dtype is torch.float32 and x.device.type == "cpu" and _onednn_on(self):
        return torch.ops.mkldnn._linear_pointwise(x, _packed(self), self.bias, "none", [], "")
    return torch.nn.functional.linear(x, self.weight, self.bias)


def _packed(linear: Any) -> Any:
    return linear.__dict__.get("_mmenc_w", linear.weight)


def _linear_gelu(linear: Any, x: "torch.Tensor", algorithm: str) -> "torch.Tensor":
    """`gelu(linear(x))` as one oneDNN call (GELU as the linear's post-op; `algorithm` is "none"
    for the exact erf GELU, "tanh" for the tanh approximation)."""
    import torch

    if x.dtype is torch.float32 and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, _packed(linear), linear.bias, "gelu", [], algorithm)
    return torch.nn.functional.gelu(torch.nn.functional.linear(x, linear.weight, linear.bias), approximate=algorithm)


def _linear_add(linear: Any, x: "torch.Tensor", residual: "torch.Tensor") -> "torch.Tensor":
    """`linear(x) + residual` as one oneDNN call (the residual add as the linear's post-op)."""
    import torch

    if x.dtype is torch.float32 and x.device.type == "cpu" and residual.dtype is torch.float32:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual.contiguous(), _packed(linear), linear.bias, "add")
    return torch.nn.functional.linear(x, linear.weight, linear.bias) + residual


def _gelu_block(first: str, second: str | None, algorithm: str) -> Callable[..., "torch.Tensor"]:
    """A block computing `act(first(x))` (then `second(...)`), the activation a GELU."""
    def forward(self: Any, hidden_states: "torch.Tensor", *args: Any, **kwargs: Any) -> "torch.Tensor":
        if not _onednn_on(self):
            return type(self).forward(self, hidden_states, *args, **kwargs)
        out = _linear_gelu(getattr(self, first), hidden_states, algorithm)
        return getattr(self, second)(out) if second else out
    return forward


def _residual_block(norm: bool) -> Callable[..., "torch.Tensor"]:
    """A block computing `dense(x) + input_tensor` (then its `LayerNorm` when `norm`)."""
    def forward(self: Any, hidden_states: "torch.Tensor", input_tensor: "torch.Tensor") -> "torch.Tensor":
        if not _onednn_on(self):
            return type(self).forward(self, hidden_states, input_tensor)
        out = _linear_add(self.dense, hidden_states, input_tensor)
        return self.LayerNorm(out) if norm else out
    return forward


def _block_candidates(module: Any) -> tuple[tuple[Any, ...], list[Callable[..., "torch.Tensor"]]] | None:
    """A random input for `module` and the fused forwards it may be computing, or None.

    Recognized by transformers' attribute names: `dense` + `intermediate_act_fn` (BERT-family
    and ViT intermediates), `fc1` + `activation_fn` + `fc2` (CLIP/SigLIP MLPs): a GELU post-op;
    `dense` + a `forward(hidden_states, input_tensor)` (BERT-family attention/FFN outputs, ViT
    outputs): the residual add as a post-op, then the block's `LayerNorm` if it has one.
    """
    import torch

    def linear(name: str) -> Any:
        layer = getattr(module, name, None)
        return layer if type(layer) is torch.nn.Linear and "_mmenc_w" in vars(layer) else None

    if (dense := linear("dense")) is not None and hasattr(module, "intermediate_act_fn"):
        x = torch.randn(2, 3, dense.in_features)
        return (x,), [_gelu_block("dense", None, a) for a in ("none", "tanh")]
    if (fc1 := linear("fc1")) is not None and hasattr(module, "activation_fn") and linear("fc2") is not None:
        x = torch.randn(2, 3, fc1.in_features)
        return (x,), [_gelu_block("fc1", "fc2", a) for a in ("none", "tanh")]
    if dense is not None and list(inspect.signature(module.forward).parameters)[:2] == ["hidden_states", "input_tensor"]:
        x, res = torch.randn(2, 3, dense.in_features), torch.randn(2, 3, dense.out_features)
        norms = [True, False] if isinstance(getattr(module, "LayerNorm", None), torch.nn.LayerNorm) else [False]
        return (x, res), [_residual_block(n) for n in norms]
    return None


def _fuse_blocks(model: Any, choice: PathChoice) -> int:
    """Fold GELUs and residual adds into the oneDNN linear before them, block by block; a block
    is switched only if its fused forward gives what its own forward gives on a random input."""
    import torch

    fused = 0
    for module in list(model.modules()):
        found = _block_candidates(module) if "forward" not in vars(module) else None
        if found is None:
            continue
        args, candidates = found
        with torch.inference_mode():
            want = module(*args)
            for forward in candidates:
                try:
                    ok = isinstance(want, torch.Tensor) and _agrees(forward(module, *args), want)
                except Exception:  # e.g. no such post-op in this build
                    ok = False
                if ok:
                    module.forward = types.MethodType(forward, module)
                    module.__dict__["_mmenc_path"] = choice
                    fused += 1
                    break
    return fused


def _agrees(got: "torch.Tensor", want: "torch.Tensor") -> bool:
    """Same float32 arithmetic up to summation order: |diff| within 1e-5 of the output's scale."""
    import torch

    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return False
    return float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))


def use_onednn_linears(model: Any) -> int:
    """On the CPU in float32, run the model's `nn.Linear` layers through oneDNN; return how many.

    PyTorch's eager `F.linear` goes to MKL's sgemm plus a separate bias pass; oneDNN's fused
    linear on a weight packed once at load into oneDNN's blocked layout (what `torch.compile`
    emits for CPU linears) is the same float32 arithmetic up to summation order (|diff| ~1e-6
    relative). Blocks that compute `gelu(linear(x))` (BERT/ViT intermediates, MLPs) also get the
    GELU as the linear's post-op, and blocks that compute `dense(x) + residual` the add, one pass
    over the activations instead of two (`_fuse_blocks`). Measured on the
    MiniLM forward, 2 threads: Intel Xeon (AVX-512), MKL already at the core's peak, +4-6%; AMD
    EPYC, where MKL's sgemm is slower, the (unpacked) oneDNN linears alone gave 1.2-1.3x. The
    packed copies cost the linear weights' size once more in memory. Every layer and block is
    switched only after a check against PyTorch's own result on a random input.

    Which path runs is then decided per batch by the model's `PathChoice` (`cpu_path_choice`):
    timed probes of the run's own batches, since oneDNN is faster on some CPUs and slower on
    others (`cpu_choice`). `MMENC_ONEDNN=1` pins oneDNN's path, `MMENC_ONEDNN=0` keeps PyTorch's
    (nothing is switched).
    """
    import torch

    setting = os.environ.get("MMENC_ONEDNN", "auto").strip().lower()
    if setting == "0":
        return 0
    try:
        if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            return 0
        layers = [m for m in model.modules() if type(m) is torch.nn.Linear
                  and m.weight.dtype is torch.float32 and m.weight.device.type == "cpu"]
        if not layers:
            return 0
        probe = layers[0]
        x = torch.randn(3, 5, probe.in_features)
        with torch.inference_mode():
            want = torch.nn.functional.linear(x, probe.weight, probe.bias)
            got = _onednn_linear(probe, x)
        if not _agrees(got, want):
            log.info("oneDNN linear disagrees with F.linear: keeping PyTorch's linear")
            return 0
    except Exception as exc:  # an older or ACL-only build: keep PyTorch's own path
        log.info("oneDNN linear unavailable (%s: %s)", type(exc).__name__, _first_line(exc))
        return 0
    choice = PathChoice("oneDNN's linears", fixed=True if setting == "1" else None)
    with torch.inference_mode():
        for layer in layers:
            _pack(layer)
            layer.forward = types.MethodType(_onednn_linear, layer)
    fused = _fuse_blocks(model, choice)
    for layer in layers:
        layer.__dict__["_mmenc_path"] = choice
    model.__dict__["_mmenc_path"] = choice
    log.info("CPU forward: %d linears through oneDNN (%d packed), %d blocks with a fused GELU or residual add; %s",
             len(layers), sum("_mmenc_w" in vars(m) for m in layers), fused,
             "pinned (MMENC_ONEDNN=1)" if choice.fixed else "used where timed probes of the run's batches find it faster")
    return len(layers)


def _pack(layer: Any) -> None:
    """Keep a oneDNN-packed copy of the layer's weight (`_mmenc_w`, not a parameter) when the
    packed linear gives what F.linear gives; else the layer stays on its plain weight."""
    import torch

    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        x = torch.randn(3, 5, layer.in_features)
        want = torch.nn.functional.linear(x, layer.weight, layer.bias)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], "")
    except Exception as exc:  # no weight packing in this build: oneDNN on the plain weight
        log.debug("oneDNN weight packing unavailable (%s: %s)", type(exc).__name__, _first_line(exc))
        return
    if _agrees(got, want):
        layer.__dict__["_mmenc_w"] = packed


_TORCH_THREADS: list[int] = []  # torch's own thread count, before the first CPU encoder changed it
MIN_STREAM_ITEMS = 8  # a batch is split across streams only into parts at least this big
PRETOKENIZE_CHUNK = 2048  # texts per tokenizer call when pretokenizing a window


def cpu_streams(device: str, compile: bool) -> int:
    """How many batch parts run concurrently on the CPU; sets torch's threads per part.

    On the CPU mmenc splits each batch in two and runs the halves on two threads, each with half
    of torch's threads (`MMENC_CPU_STREAMS=N` for another count, 1 to turn it off). Two
    independent forwards keep the cores busy through the serial stretches and OpenMP barriers of
    one forward (layer norms, softmax, Python between ops): ~10% more texts/s for MiniLM on two
    cores. Off on accelerators and under --compile.
    """
    import torch

    if device != "cpu":
        return 1
    if not _TORCH_THREADS:
        _TORCH_THREADS.append(torch.get_num_threads())
    total = _TORCH_THREADS[0]
    want = os.environ.get("MMENC_CPU_STREAMS")
    streams = 1 if compile else (int(want) if want and want.strip().isdigit() else 2)
    streams = max(1, min(streams, total))
    torch.set_num_threads(max(1, total // streams))
    return streams


@contextlib.contextmanager
def _all_threads(active: bool) -> Iterator[None]:
    """Run a lone batch part (a small batch, a bisected chunk) with all of torch's CPU threads,
    not the share each of several concurrent streams gets."""
    if not active or not _TORCH_THREADS:
        yield
        return
    import torch

    share = torch.get_num_threads()
    torch.set_num_threads(_TORCH_THREADS[0])
    try:
        yield
    finally:
        torch.set_num_threads(share)


@dataclass(slots=True)
class TokenizedText:
    """One text tokenized without padding: the tokenizer's per-text features (input_ids, and
    token_type_ids where the model has them) and whether truncation cut it."""

    features: dict[str, list[int]]
    truncated: bool

    def __len__(self) -> int:
        return len(self.features["input_ids"])


class ForwardTimer:
    """Times forward passes on a CUDA device with CUDA events, without synchronizing: the events
    of a pass are read once the GPU has passed them (the pipeline's copy of the vectors to the
    host waits for that anyway). A no-op elsewhere. Used as `with timer: forward()`."""

    def __init__(self, device: str) -> None:
        self.cuda = str(device).startswith("cuda")
        self._pending: list[tuple[Any, Any]] = []
        self._done = 0.0

    def __enter__(self) -> None:
        if self.cuda:
            import torch

            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            self._pending.append((begin, end))

    def __exit__(self, *exc: Any) -> None:
        if self.cuda and self._pending:
            self._pending[-1][1].record()
            self._collect(wait=False)

    def _collect(self, wait: bool) -> None:
        keep = []
        for begin, end in self._pending:
            if wait or end.query():
                end.synchronize()
                self._done += begin.elapsed_time(end) / 1000.0
            else:
                keep.append((begin, end))
        self._pending = keep

    def seconds(self) -> float | None:
        if not self.cuda:
            return None
        self._collect(wait=True)
        return self._done


class CompiledOrEager:
    """Calls `fn` through `torch.compile`; if compiling fails, warns once and stays eager.

    A failure on a call that also fails eagerly is the input's fault, not the compiler's: it is
    raised and compilation is kept.
    """

    def __init__(self, fn: Callable[[Inputs], "torch.Tensor"], name: str) -> None:
        import torch

        self.fn, self.name, self.proven = fn, name, False
        self.compiled: Callable[[Inputs], "torch.Tensor"] | None = torch.compile(fn)

    def __call__(self, inputs: Inputs) -> "torch.Tensor":
        if self.compiled is None:
            return self.fn(inputs)
        try:
            out = self.compiled(inputs)
        except Exception as exc:
            if self.proven and not type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
                raise
            out = self.fn(inputs)  # raises if the input itself is at fault
            log.warning("torch.compile failed for %s (%s: %s); running eager", self.name,
                        type(exc).__name__, _first_line(exc))
            self.compiled = None
            return out
        self.proven = True
        return out


# ------------------------------------------------------------------------------------- encoder


class HFEncoder:
    """Shared body of the transformers-backed adapters (implements the `Encoder` protocol).

    Subclasses set `family` and implement `_embed_image(inputs)` and/or `_embed_text(inputs)`
    returning `[n, dim]` tensors; a modality is offered when its processor/tokenizer loaded.
    """

    family = "hf"
    output_kind = "pooled"

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 tokenizer: Any = None, image_processor: Any = None, max_length: int | None = None,
                 pad_to_max_length: bool = False, lowercase: bool = False, default_normalize: bool,
                 pooling: str, unavailable: dict[str, str] | None = None) -> None:
        import torch

        self.model, self.device = model, device
        self.dtype = next(model.parameters()).dtype
        # inductor packs CPU linears itself under --compile
        onednn = use_onednn_linears(model) if device == "cpu" and not cfg.compile else 0
        self._streams = cpu_streams(device, cfg.compile)
        self._path = cpu_path_choice(model) if onednn else None
        self._timer = ForwardTimer(device)
        self._pool: ThreadPoolExecutor | None = None
        if self._streams > 1:
            self._pool = ThreadPoolExecutor(self._streams, thread_name_prefix="mmenc-cpu")
        self.default_normalize = default_normalize
        self._tokenizer, self.max_length = tokenizer, max_length
        self._padding = "max_length" if pad_to_max_length else True
        self._lowercase = lowercase
        self._prep: ImagePreprocessor | None = None
        self._table = None
        if image_processor is not None:
            self._prep, table = plan_image_input(image_processor)
            if table is not None:
                self._table_np = table  # [3, 256] float32, for the CPU path
                self._table = torch.from_numpy(table).reshape(-1).to(device)
                self._offsets = (torch.arange(3, dtype=torch.int32, device=device) * 256).view(1, 3, 1, 1)
        offered = {"image": self._prep is not None and hasattr(self, "_embed_image"),
                   "text": tokenizer is not None and hasattr(self, "_embed_text")}
        self.modalities = frozenset(m for m, ok in offered.items() if ok)
        if not self.modalities:
            reasons = "; ".join((unavailable or {}).values())
            raise ModelLoadError(f"{probe.source}: no usable modality ({reasons})")
        self.info: dict[str, Any] = {
            "model": cfg.model, "revision": cfg.revision, "commit": probe.commit, "family": self.family,
            "model_type": probe.model_type, "pooling": pooling, "max_length": max_length,
            "device": device, "dtype": str(self.dtype).removeprefix("torch."),
            "image_input": None if self._prep is None else "uint8" if self._table is not None else "float32",
            "default_normalize": default_normalize, "compile": cfg.compile,
            "cpu_linear": None if self._path is None else "onednn" if self._path.fixed else "auto", "cpu_streams": self._streams if device == "cpu" else None,
            "unavailable": dict(unavailable or {}),
        }
        self._run: dict[str, Callable[[Inputs], "torch.Tensor"]] = {
            m: getattr(self, f"_embed_{m}") for m in self.modalities}
        self.dim = self._probe_dim()
        if cfg.compile:
            self._run = {m: CompiledOrEager(fn, f"{self.family} {m}") for m, fn in self._run.items()}

    # -- Encoder protocol

    def image_preprocessor(self) -> ImagePreprocessor:
        """The picklable worker-side preprocessor (torch-free on the uint8 path)."""
        if self._prep is None:
            raise ValueError(f"{self.info['model']}: this model does not encode images")
        return self._prep

    def encode(self, modality: str, payloads: Sequence[Any]) -> EncodeOutput:
        """Encode images (`ImageInput`s) or texts; float32 vectors, left on the device."""
        import torch

        if modality not in self.modalities:
            raise ValueError(f"this model does not encode {modality!r}")
        parts = self._split(payloads)
        if self._path is not None:
            self._path.begin()  # which CPU linears this batch runs on
        t0 = time.perf_counter()
        if len(parts) == 1:
            with torch.inference_mode(), _all_threads(self._pool is not None):
                inputs, truncated = self._inputs(modality, payloads)
                with self._timer:
                    vectors = self._run[modality](inputs).float()
            if self._path is not None and self._pool is None:  # timed like every batch of a one-stream run
                self._path.end(time.perf_counter() - t0, _units(inputs))
            return EncodeOutput(vectors, truncated)
        assert self._pool is not None
        futures, truncated, error, units = [], [], None, 0
        for part in parts:
            try:
                # inputs are made on this thread (tokenizers are not safe to share across
                # threads), each part's forward starting while the next part is prepared
                with torch.inference_mode():
                    inputs, part_truncated = self._inputs(modality, part)
            except Exception as exc:
                error = exc
                break
            futures.append(self._pool.submit(self._forward, modality, inputs))
            truncated += part_truncated
            units += _units(inputs)
        outputs = []
        for future in futures:  # wait for every part before raising: no forward outlives the call
            try:
                outputs.append(future.result())
            except Exception as exc:  # the batching stage bisects or backs off on it
                error = error or exc
        if error is not None:
            raise error
        if self._path is not None and len(parts) == self._streams:  # full batches only: same threads per part
            self._path.end(time.perf_counter() - t0, units)
        return EncodeOutput(torch.cat(outputs), truncated)

    def cpu_path_summary(self) -> str | None:
        """Which CPU linears the run used and why (None where there was no choice)."""
        return None if self._path is None else self._path.summary()

    def device_seconds(self) -> float | None:
        """Seconds the accelerator spent in forward passes so far (CUDA events), None on the CPU."""
        return self._timer.seconds()

    def _split(self, payloads: Sequence[Any]) -> list[Sequence[Any]]:
        """Contiguous parts of a batch, one per CPU stream (the whole batch when small or on a GPU)."""
        n = len(payloads)
        k = min(self._streams, n // MIN_STREAM_ITEMS) if self._pool is not None else 1
        if k <= 1:
            return [payloads]
        bounds = [n * i // k for i in range(k + 1)]
        return [payloads[bounds[i]:bounds[i + 1]] for i in range(k)]

    def _inputs(self, modality: str, payloads: Sequence[Any]) -> tuple[Inputs, list[bool]]:
        if modality == "image":
            return self.collate_images(payloads), []
        return self.tokenize(payloads)

    def _forward(self, modality: str, inputs: Inputs) -> "torch.Tensor":
        import torch

        with torch.inference_mode():  # thread-local: entered again on the stream's thread
            return self._run[modality](inputs).float()

    # -- inputs

    def pretokenize(self, texts: Sequence[str], tokenizer: Any = None) -> list["TokenizedText"]:
        """Tokenize texts without padding (truncated at `max_length`), a few thousand per call.

        The pipeline sorts a window of texts by these token counts before cutting it into
        batches, and `encode` then only pads: bucketing by tokens instead of characters leaves
        ~1.04x the real tokens in the batches instead of ~1.13x (benchmark corpus, windows of 4096).
        Calls take `PRETOKENIZE_CHUNK` texts: a fast tokenizer's full `Encoding` objects (tokens,
        offsets, ...) of a whole window would cost several times what is kept (the id lists).
        """
        tokenizer = self._tokenizer if tokenizer is None else tokenizer
        out: list[TokenizedText] = []
        for start in range(0, len(texts), PRETOKENIZE_CHUNK):
            part = texts[start:start + PRETOKENIZE_CHUNK]
            part = [t.lower() for t in part] if self._lowercase else list(part)
            enc = tokenizer(part, padding=False, truncation=True, max_length=self.max_length,
                            return_attention_mask=False)
            truncated = self._truncated(part, enc, tokenizer)
            keys = [k for k in enc.keys() if k != "attention_mask"]
            out += [TokenizedText({k: enc[k][i] for k in keys}, truncated[i]) for i in range(len(part))]
        return out

    def pretokenizer(self) -> Callable[[Sequence[str]], list["TokenizedText"]]:
        """`pretokenize` on a copy of the tokenizer, for one other thread (the pipeline's
        tokenize-ahead thread): a fast tokenizer's truncation and padding are set on it at every
        call, so the thread that pads batches and another that tokenizes must not share one."""
        return functools.partial(self.pretokenize, tokenizer=copy.deepcopy(self._tokenizer))

    def _truncated(self, texts: Sequence[str], enc: Any, tokenizer: Any = None) -> list[bool]:
        encodings = getattr(enc, "encodings", None)
        if encodings:  # fast tokenizers record the cut-off tail: no second pass needed
            return [bool(e.overflowing) for e in encodings]
        full = (tokenizer or self._tokenizer)(texts, truncation=False, padding=False)["input_ids"]
        return [len(ids) > self.max_length for ids in full]

    def _pad(self, items: Sequence["TokenizedText"]) -> tuple[Inputs, list[bool]]:
        """Pad pretokenized texts exactly as the tokenizer pads when it tokenizes (side, ids, mask)."""
        import torch

        # the tokenizer warns that __call__ is faster than encode-then-pad: not when the pad is
        # all that is left to do
        warned = getattr(self._tokenizer, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["Asking-to-pad-a-fast-tokenizer"] = True
        features = {k: [it.features[k] for it in items] for k in items[0].features}
        limit = {"max_length": self.max_length} if self._padding == "max_length" else {}
        enc = self._tokenizer.pad(features, padding=self._padding, return_tensors="np", **limit)
        tensors = {k: to_device(torch.from_numpy(np.ascontiguousarray(v)), self.device) for k, v in enc.items()}
        return tensors, [it.truncated for it in items]

    def tokenize(self, texts: Sequence[Any]) -> tuple[Inputs, list[bool]]:
        """Tokenize with truncation at `max_length`; also say which texts lost tokens.

        `texts` are strings, or `TokenizedText`s from `pretokenize` (then only padded)."""
        import torch

        if any(isinstance(t, TokenizedText) for t in texts):
            return self._pad([t if isinstance(t, TokenizedText) else self.pretokenize([t])[0] for t in texts])
        texts = [t.lower() for t in texts] if self._lowercase else list(texts)
        # numpy, then a zero-copy `from_numpy`: transformers builds "pt" tensors with
        # `torch.tensor(list of lists)`, which costs more than the tokenizing itself on short texts
        enc = self._tokenizer(texts, padding=self._padding, truncation=True, max_length=self.max_length,
                              return_tensors="np")
        truncated = self._truncated(texts, enc)
        return {k: to_device(torch.from_numpy(np.ascontiguousarray(v)), self.device) for k, v in enc.items()}, truncated

    def collate_images(self, items: Sequence[ImageInput]) -> Inputs:
        """Stack worker outputs into a device batch; uint8 pixels become normalized floats here."""
        import torch

        stacked = np.stack([it.pixels for it in items])
        if stacked.dtype == np.uint8 and self.device == "cpu" and stacked.ndim == 4 and stacked.shape[1] == 3:
            # exact: the table holds the processor's own float32 result for each (channel, value);
            # numpy's take on uint8 indices is ~3x faster than an int32 gather in torch on the CPU
            out = np.empty(stacked.shape, dtype=np.float32)
            for c in range(3):
                np.take(self._table_np[c], stacked[:, c], out=out[:, c], mode="clip")
            pixels = torch.from_numpy(out)
        else:
            # on an accelerator the compact uint8 batch crosses the bus and is normalized there
            pixels = to_device(torch.from_numpy(stacked), self.device)
            if pixels.dtype == torch.uint8:
                pixels = self._table[pixels.int() + self._offsets]
        inputs = {"pixel_values": pixels.to(self.dtype)}
        for key in items[0].meta.get("inputs", {}):
            inputs[key] = to_device(torch.from_numpy(np.stack([it.meta["inputs"][key] for it in items])),
                                    self.device)
        return inputs

    def _probe_dim(self) -> int:
        """Encode one dummy item per modality: fixes `dim` and fails at startup, not at batch one."""
        from PIL import Image

        dims = {}
        for modality in sorted(self.modalities):
            dummy = self._prep(Image.new("RGB", (48, 40), (120, 90, 60))) if modality == "image" else "mmenc"
            try:
                vectors = self.encode(modality, [dummy]).vectors
            except ModelLoadError:
                raise
            except Exception as exc:
                raise ModelLoadError(f"{self.info['model']}: a test {modality} encode failed: "
                                     f"{type(exc).__name__}: {_first_line(exc)}") from exc
            if vectors.ndim != 2 or vectors.shape[0] != 1:
                raise ModelLoadError(f"{self.info['model']}: {modality} output has shape "
                                     f"{tuple(vectors.shape)}, expected (1, dim)")
            dims[modality] = int(vectors.shape[1])
        if len(set(dims.values())) > 1:
            raise ModelLoadError(f"{self.info['model']}: image and text dimensions differ: {dims}")
        return next(iter(dims.values()))


def pooled(output: Any) -> "torch.Tensor":
    """`get_*_features` returns a tensor in transformers 4 and a model output in 5 (projected
    embeddings in `pooler_output`)."""
    import torch

    return output if isinstance(output, torch.Tensor) else output.pooler_output


# ------------------------------------------------------------------------- CLIP / SigLIP family


class DualTowerEncoder(HFEncoder):
    """CLIP, SigLIP and SigLIP 2: `get_image_features` / `get_text_features` (projected, pooled).

    SigLIP's text tower pools the last position and was trained on texts padded to the full
    length, so its texts are padded to `max_length` as SigLIP's documentation prescribes.
    """

    family = "clip"

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any,
                 **kwargs: Any) -> None:
        self._image_keys = keep_accepted(model.get_image_features)
        self._text_keys = keep_accepted(model.get_text_features)
        super().__init__(probe, cfg, device, model, **kwargs)

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        return pooled(self.model.get_image_features(**self._image_keys(inputs)))

    def _embed_text(self, inputs: Inputs) -> "torch.Tensor":
        return pooled(self.model.get_text_features(**self._text_keys(inputs)))


def load_dual(probe: ModelProbe, cfg: "ModelConfig", device: str) -> HFEncoder:
    """Load a CLIP / SigLIP / SigLIP 2 model with whichever of its two processors exist."""
    model, _ = load_model(probe, cfg, device, resolve_dtype(cfg.dtype, device))
    tokenizer, no_text = load_part("text", probe, cfg)
    processor, no_image = load_part("image", probe, cfg)
    max_length = None
    if tokenizer is not None:
        text_config = getattr(probe.config, "text_config", probe.config)
        max_length = text_limit(tokenizer, text_config, None, cfg.max_length)
    unavailable = {k: v for k, v in (("text", no_text), ("image", no_image)) if v}
    return DualTowerEncoder(probe, cfg, device, model, tokenizer=tokenizer, image_processor=processor,
                            max_length=max_length, pad_to_max_length=probe.model_type != "clip",
                            default_normalize=True, pooling="projection", unavailable=unavailable)


# ---------------------------------------------------------------------- vision backbone family

#: ViT-style models whose sequence starts with CLS (+ DeiT's distillation token, + DINOv2/v3
#: registers): the only ones where `cls` and `mean` pooling are well defined.
PREFIX_TOKENS: dict[str, int] = {"vit": 1, "vit_msn": 1, "deit": 2, "dinov2": 1,
                                 "dinov2_with_registers": 1, "dinov3_vit": 1}


class VisionEncoder(HFEncoder):
    """An image-only backbone (ViT, DINOv2, ...): pooled from the model's forward output.

    * `cls`: `last_hidden_state[:, 0]` (after the final layer norm, as DINOv2 and ViT output it).
    * `mean`: mean over the patch tokens only, excluding CLS and any distillation/register tokens:
      the convention of DINOv2's own linear-probe head and of timm's `global_pool="avg"`.
    * `auto`: the model's own `pooler_output` if it produces one from trained weights (ViT's
      dense+tanh pooler, DINOv2's normed CLS, ConvNeXt's pooled features), else `cls`.
    """

    family = "vision"

    def __init__(self, probe: ModelProbe, cfg: "ModelConfig", device: str, model: Any, *,
                 prefix: int | None, pooler_ok: bool, **kwargs: Any) -> None:
        self._prefix, self._pooler_ok = prefix, pooler_ok
        self._pooling = kwargs["pooling"]  # "auto" is settled by the load-time probe
        self._keys = keep_accepted(model.forward)
        super().__init__(probe, cfg, device, model, **kwargs)
        self.info["pooling"] = self._pooling

    def _embed_image(self, inputs: Inputs) -> "torch.Tensor":
        out = self.model(**self._keys(inputs))
        if self._pooling == "auto":
            if self._pooler_ok and getattr(out, "pooler_output", None) is not None:
                self._pooling = "pooler"
            elif self._prefix is not None:
                self._pooling = "cls"
            else:
                raise ModelLoadError(f"{self.info['model']}: {self.info['model_type']!r} has no usable "
                                     "pooler output and no CLS token mmenc knows how to pool")
        if self._pooling == "pooler":
            return out.pooler_output.flatten(1)
        hidden = out.last_hidden_state
        if self._pooling == "cls":
            return hidden[:, 0]
        return hidden[:, self._prefix:].mean(dim=1)


def load_vision(probe: ModelProbe, cfg: "ModelConfig", device: str) -> HFEncoder:
    """Load an image-only backbone; `cls`/`mean` need a ViT-style model (see `PREFIX_TOKENS`)."""
    model_type = probe.model_type or ""
    prefix = None
    if model_type in PREFIX_TOKENS:
        prefix = PREFIX_TOKENS[model_type] + int(getattr(probe.config, "num_register_tokens", 0) or 0)
    elif cfg.pooling in ("cls", "mean"):
        raise ModelLoadError(f"--pooling {cfg.pooling} is defined only for ViT-style models "
                             f"({', '.join(sorted(PREFIX_TOKENS))}), not {model_type!r}; use --pooling auto")
    model, missing = load_model(probe, cfg, device, resolve_dtype(cfg.dtype, device))
    processor, no_image = load_part("image", probe, cfg)
    if processor is None:
        raise ModelLoadError(f"{probe.source}: {no_image}")
    # a pooler whose weights the checkpoint lacks (e.g. ViTForImageClassification weights loaded
    # into ViTModel) is random: never use it for `auto`
    pooler_ok = not any(k.startswith("pooler.") for k in missing)
    return VisionEncoder(probe, cfg, device, model, prefix=prefix, pooler_ok=pooler_ok,
                         image_processor=processor, default_normalize=False, pooling=cfg.pooling)
