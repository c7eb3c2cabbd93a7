"""Where mmenc's texts/s goes, against sentence-transformers, in one process (CPU).

    python benchmarks/bench_texts_parts.py [--texts 2000] [--rounds 8] [--batch-size 32] [--cpu-forward auto]

`bench_texts.py` compares whole runs; this splits mmenc's side into layers, so that a gap to the
target (>= 1.2x sentence-transformers' `encode`) can be placed. One process, the models loaded
once, per round every variant on the same texts, the order rotated each round:

  st        `SentenceTransformer.encode(texts, batch_size=B)` (torch's threads, sorts by characters)
  forward   the ceiling of mmenc's CPU design for this model: the texts pretokenized, sorted by
            tokens and padded into parts of B/2 beforehand, and two threads (one torch thread
            each, as mmenc's two CPU streams) each running the model + pooling over every other
            part, never waiting for each other. No tokenizing, no pipeline, no barrier.
  encode    `HFEncoder.encode` over the sorted, pretokenized batches of B: pads each batch,
            splits it into the two streams' halves and waits for both (what `run_encode` calls)
  run       `run_encode`: the whole pipeline, manifest to Parquet shards

Prints per round texts/s and, per variant, the median of its per-round ratios to st. The forward
variant runs whichever CPU linears the encoder's choice holds at that moment (`--cpu-forward
onednn` pins oneDNN's for all variants, `plain` runs PyTorch's own forward on one stream).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_texts import model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--variants", default="st,forward,encode,run", help="which, comma-separated (ratios need st)")
    ap.add_argument("--cpu-forward", default="auto", choices=("auto", "plain", "onednn"))
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from mmenc_cli.config import BatchConfig, ModelConfig, RunConfig, WriterConfig
    from mmenc_cli.encoders import load_encoder
    from mmenc_cli.run.pipeline import run_encode

    model, bs = model_dir(), args.batch_size
    print(common.machine("cpu"), flush=True)
    work = common.CACHE / "work-texts-parts"
    texts = common.text_corpus(args.texts, vocab_file=model / "vocab.txt")
    manifest = common.write_manifest(work / f"texts-{args.texts}.jsonl",
                                     ({"id": f"t{i}", "text": t} for i, t in enumerate(texts)))
    print(f"{args.texts} texts, batch size {bs}, {args.rounds} rounds, float32; --cpu-forward {args.cpu_forward}",
          flush=True)

    threads = torch.get_num_threads()
    st = SentenceTransformer(str(model), device="cpu")
    st.encode(texts[:bs], batch_size=bs)
    cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(model), device="cpu", dtype="float32",
                                                                  cpu_forward=args.cpu_forward),
                    writer=WriterConfig(out=str(work / "out")), batch=BatchConfig(batch_size=bs),
                    modalities=("text",), overwrite=True)
    encoder = load_encoder(cfg.model, device="cpu")
    stream_threads = torch.get_num_threads()  # the encoder's streams set torch's threads per stream
    pre = encoder.pretokenize(texts)
    pre.sort(key=lambda t: len(t.features["input_ids"]))
    batches = [pre[i:i + bs] for i in range(0, len(pre), bs)]
    half = max(1, bs // 2)
    parts = [encoder.tokenize(pre[i:i + half])[0] for i in range(0, len(pre), half)]

    def stream(own: list) -> None:
        with torch.inference_mode():
            for inputs in own:
                encoder._embed_text(inputs)

    def forward() -> None:
        workers = [threading.Thread(target=stream, args=(parts[i::2],)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def encode() -> None:
        for batch in batches:
            encoder.encode("text", batch).vectors.numpy()

    def run() -> None:
        result = run_encode(cfg, encoder_factory=lambda c, device=None: encoder)
        assert result.counters.encoded == len(texts), result.counters.to_dict()

    def st_encode() -> None:
        torch.set_num_threads(threads)
        try:
            st.encode(texts, batch_size=bs, convert_to_numpy=True)
        finally:
            torch.set_num_threads(stream_threads)

    variants = {"st": st_encode, "forward": forward, "encode": encode, "run": run}
    names = [v for v in args.variants.split(",") if v in variants]
    if "st" not in names:
        names.insert(0, "st")
    seconds: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            seconds[name].append(time.perf_counter() - t0)
        print(f"  round {r + 1}: " + ", ".join(f"{k} {args.texts / seconds[k][-1]:.1f}" for k in names)
              + " texts/s", flush=True)
    print(f"\nmedian of {args.rounds} rounds (texts/s; ratio = median of the per-round st/variant time ratios):")
    for name in names:
        ratios = [a / b for a, b in zip(seconds["st"], seconds[name])]
        print(f"  {name:8s} {common.median([args.texts / s for s in seconds[name]]):7.1f} texts/s  "
              f"{common.median(ratios):.2f}x st  (rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"  CPU forward: {common.cpu_path_text(encoder.forward_summary())}")


if __name__ == "__main__":
    main()
