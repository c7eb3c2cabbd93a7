"""How close the CPU forward's kernels are to what this core does: GFLOP/s per kernel, one thread.

    python benchmarks/bench_cpu_kernels.py [--threads 1] [--reps-gflop 20]

The kernels of an all-MiniLM-L6-v2 forward as mmenc's CPU streams run them (one torch thread
per stream), at its shapes: hidden 384, intermediate 1536, 12 heads of 32, batch parts of 16
texts of 12-96 tokens. All in one process, each against a baseline measured beside it:

  linears    PyTorch's float32 `F.linear` (the baseline), oneDNN's float32 linear on the weight
             packed as mmenc packs it, and PyTorch's bfloat16 `F.linear` (what `--dtype bfloat16`
             runs), for M = 240-1920 rows (tokens in a batch part)
  attention  `F.scaled_dot_product_attention` (what transformers' sdpa runs; the baseline) against
             the eager form (matmul, additive mask, softmax, matmul) per sequence length

Prints GFLOP/s and the ratio to the baseline. When the float32 linears run at the same GFLOP/s
for every M and oneDNN's is the faster, the float32 forward is as fast as its linears go here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def per_call(fn: Callable[[], object], flops: float, work: float) -> float:
    """Seconds per call (best of 3 timed blocks, each about `work` GFLOP) after a warm-up."""
    reps = max(5, int(work * 1e9 / flops))
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (mmenc's CPU streams use 1 each on 2 cores)")
    ap.add_argument("--reps-gflop", type=float, default=20.0, help="GFLOP per timed block")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(common.machine("cpu"), flush=True)
    print(f"torch threads {args.threads}; bfloat16 in oneDNN: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    work = args.reps_gflop
    print("\nlinears (GFLOP/s; ratio to PyTorch float32):")
    with torch.inference_mode():
        for k, n in ((384, 384), (384, 1536), (1536, 384)):
            w, b = torch.randn(n, k), torch.randn(n)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            w16, b16 = w.bfloat16(), b.bfloat16()
            for m in (240, 480, 960, 1920):
                x = torch.randn(m, k)
                x16 = x.bfloat16()
                flops = 2.0 * m * k * n
                base = per_call(lambda: F.linear(x, w, b), flops, work)
                dnn = per_call(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""), flops, work)
                bf16 = per_call(lambda: F.linear(x16, w16, b16), flops, work)
                print(f"  {k:4d}->{n:4d}, M {m:4d}: PyTorch fp32 {flops / base / 1e9:6.1f}, "
                      f"oneDNN fp32 {flops / dnn / 1e9:6.1f} ({base / dnn:.2f}x), "
                      f"PyTorch bf16 {flops / bf16 / 1e9:6.1f} ({base / bf16:.2f}x)")
        print("\nattention, 16 x 12 heads x 32, half the rows padded to half length "
              "(microseconds per call; ratio = sdpa time / eager time):")
        mn = torch.finfo(torch.float32).min
        for length in (12, 20, 30, 48, 64, 96, 128):
            q, k_, v = (torch.randn(16, 12, length, 32) for _ in range(3))
            keep = torch.ones(16, 1, length, length, dtype=torch.bool)
            keep[:8, :, :, length // 2:] = False
            add = torch.zeros(16, 1, length, length).masked_fill(~keep, mn)
            flops = 4.0 * 16 * 12 * length * length * 32

            def eager() -> torch.Tensor:
                s = torch.matmul(q, k_.transpose(-1, -2)).mul_(32 ** -0.5).add_(add)
                return torch.matmul(torch.softmax(s, -1), v)

            sdpa = per_call(lambda: F.scaled_dot_product_attention(q, k_, v, attn_mask=keep), flops, work / 20)
            eag = per_call(eager, flops, work / 20)
            print(f"  length {length:3d}: sdpa {sdpa * 1e6:7.0f} us, eager {eag * 1e6:7.0f} us ({sdpa / eag:.2f}x)")


if __name__ == "__main__":
    main()
