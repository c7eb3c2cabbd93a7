"""oneDNN's linears on the CPU: weights packed once at load, GELUs and residual adds fused as post-ops.

PyTorch's eager `F.linear` goes to MKL's sgemm plus a separate bias pass; oneDNN's fused linear on
a weight packed once into oneDNN's blocked layout (what `torch.compile` emits for CPU linears) is
the same float32 arithmetic up to summation order. Every layer and block is switched only after a
check against its own PyTorch result on a random input. Which path a batch takes is then decided
by the model's `PathChoice` (`choice.py`): pinned with `--cpu-forward onednn`, chosen by timed
probes of the run's own batches with `--cpu-forward auto`.
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import TYPE_CHECKING, Any, Callable

from ...errors import first_line
from .choice import PathChoice

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("mmenc")


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


def use_onednn_linears(model: Any, pinned: bool = False) -> int:
    """On the CPU in float32, run the model's `nn.Linear` layers through oneDNN; return how many.

    Blocks that compute `gelu(linear(x))` (BERT/ViT intermediates, MLPs) also get the GELU as the
    linear's post-op, and blocks that compute `dense(x) + residual` the add, one pass over the
    activations instead of two (`_fuse_blocks`). The packed copies cost the linear weights' size
    once more in memory. Which path a batch runs is then the model's `PathChoice`
    (`cpu_path_choice`): oneDNN's when `pinned`, else chosen by timed probes of the run's own
    batches, since oneDNN is faster on some CPUs and slower on others (`choice.py`). Returns 0
    (nothing switched) where oneDNN is missing or disagrees with `F.linear`.
    """
    import torch

    layers = _onednn_layers(model)
    if not layers:
        return 0
    choice = PathChoice("oneDNN's linears", fixed=True if pinned else None)
    with torch.inference_mode():
        for layer in layers:
            _pack(layer)
            layer.forward = types.MethodType(_onednn_linear, layer)
    fused = _fuse_blocks(model, choice)
    for layer in layers:
        layer.__dict__["_mmenc_path"] = choice
    model.__dict__["_mmenc_path"] = choice
    log.debug("CPU forward: %d linears through oneDNN (%d packed), %d blocks with a fused GELU or residual add; %s",
              len(layers), sum("_mmenc_w" in vars(m) for m in layers), fused,
              "pinned" if choice.fixed else "used where timed probes of the run's batches find it faster")
    return len(layers)


def _onednn_layers(model: Any) -> list[Any]:
    """The model's float32 CPU `nn.Linear` layers, or [] when oneDNN's linear is unavailable in
    this build or disagrees with `F.linear` on a random input."""
    import torch

    try:
        if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            return []
        layers = [m for m in model.modules() if type(m) is torch.nn.Linear
                  and m.weight.dtype is torch.float32 and m.weight.device.type == "cpu"]
        if not layers:
            return []
        probe = layers[0]
        x = torch.randn(3, 5, probe.in_features)
        with torch.inference_mode():
            want = torch.nn.functional.linear(x, probe.weight, probe.bias)
            got = _onednn_linear(probe, x)
    except Exception as exc:  # an older or ACL-only build: keep PyTorch's own path
        log.debug("oneDNN linear unavailable (%s: %s)", type(exc).__name__, first_line(exc))
        return []
    if not _agrees(got, want):
        log.debug("oneDNN linear disagrees with F.linear: keeping PyTorch's linear")
        return []
    return layers


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
        log.debug("oneDNN weight packing unavailable (%s: %s)", type(exc).__name__, first_line(exc))
        return
    if _agrees(got, want):
        layer.__dict__["_mmenc_w"] = packed
