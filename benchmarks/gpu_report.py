"""What `gpu_bench.py` reports: the goals with each figure beside them (met / not met / not
measured), the ratios, one line per stage, and the agreement of vectors between runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: the least cosine between two runs' vectors of one id that counts as the same embedding
MIN_COSINE = 0.99


@dataclass(frozen=True)
class Goal:
    """One goal on one H100: `key` in the summary's numbers, at least `target`; `cpus` the usable
    CPUs it is stated for (another count: not measured)."""

    text: str
    key: str
    target: float
    measure: str
    cpus: int | None = None


GOALS = [
    Goal("ViT-B/16 --decode gpu >= 90% of its forward-only limit", "b16_gpu_share", 0.90,
         "steady-state images/s (first forward to last) / forward-only images/s"),
    Goal("ViT-B/16 --decode fast >= 60% of its forward-only limit, 16 cores", "b16_fast_share", 0.60,
         "steady-state images/s / forward-only images/s", cpus=16),
    Goal("ViT-L/14 >= 95% of its forward-only limit in steady state", "l14_share", 0.95,
         "steady-state images/s (--decode fast) / forward-only images/s"),
    Goal("MiniLM texts (bf16, batch 256) >= 1.5x sentence-transformers", "texts_ratio", 1.5,
         "texts/s excluding model load (mmenc's run, sentence-transformers' encode call)"),
]


def cosines(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """Cosine between `a`'s and `b`'s vectors (ids, [n, dim]) of each id both have: count, min,
    median; and, so a reader sees whether `MIN_COSINE` tells images apart at all (random weights
    can map everything close together), the median cosine between `a`'s vectors of neighbouring
    rows (other files: the rows cycle through them)."""
    index = {str(i): k for k, i in enumerate(b[0])}
    pairs = [(k, index[str(i)]) for k, i in enumerate(a[0]) if str(i) in index]
    if not pairs:
        return {"ids": 0, "min": None, "median": None, "other_ids_median": None}
    x = unit(a[1][[p for p, _ in pairs]])
    y = unit(b[1][[q for _, q in pairs]])
    cos = (x * y).sum(1)
    other = (x * np.roll(x, 1, axis=0)).sum(1) if len(x) > 1 else np.array([np.nan])
    return {"ids": len(pairs), "min": round(float(cos.min()), 6), "median": round(float(np.median(cos)), 6),
            "other_ids_median": round(float(np.median(other)), 4)}


def unit(m: np.ndarray) -> np.ndarray:
    m = m.astype(np.float64)
    return m / (np.linalg.norm(m, axis=1, keepdims=True) + 1e-30)


def check_agreement(found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`found` (pair name -> `cosines`) as a stage's record; RuntimeError when a pair's least
    cosine is under `MIN_COSINE` or no id is shared (the stage fails: a fast wrong run is no result)."""
    bad = {k: v for k, v in found.items() if v["min"] is None or v["min"] < MIN_COSINE}
    if bad:
        raise RuntimeError(f"vectors disagree (min cosine < {MIN_COSINE} or no shared id): {bad}")
    return found


def summary(st: dict[str, dict[str, Any]], mode: str, cpus: int | None) -> dict[str, Any]:
    """The numbers the goals are about, and each goal's verdict."""
    def val(stage: str, key: str) -> float | None:
        entry = st.get(stage, {})
        return entry.get(key) if entry.get("status") == "ok" else None

    def div(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    limit_b16, limit_l14 = val("limit_b16", "images_per_s"), val("limit_l14", "images_per_s")
    nums = {"b16_gpu_share": div(val("mmenc_b16_gpu", "steady_per_s"), limit_b16),
            "b16_gpu_share_whole_run": div(val("mmenc_b16_gpu", "images_per_s"), limit_b16),
            "b16_fast_share": div(val("mmenc_b16_fast", "steady_per_s"), limit_b16),
            "b16_fast_share_whole_run": div(val("mmenc_b16_fast", "images_per_s"), limit_b16),
            "l14_share": div(val("mmenc_l14_fast", "steady_per_s"), limit_l14),
            "l14_share_whole_run": div(val("mmenc_l14_fast", "images_per_s"), limit_l14),
            "texts_ratio": div(val("texts_mmenc", "texts_per_s"), val("texts_st", "texts_per_s")),
            "texts_ratio_steady": div(val("texts_mmenc", "steady_per_s"), val("texts_st", "texts_per_s")),
            "b16_fast_vs_baseline": div(val("mmenc_b16_fast", "steady_per_s"), val("baseline_b16", "images_per_s")),
            "b16_default_batch_share": div(val("mmenc_b16_default_batch", "steady_per_s"),
                                           val("mmenc_b16_fast", "steady_per_s"))}
    goals = [{"goal": g.text, "measure": g.measure, "value": nums[g.key], "target": g.target,
              "verdict": verdict(g, nums[g.key], mode, cpus)} for g in GOALS]
    return {"numbers": nums, "goals": goals, "failed": [k for k, v in st.items() if v["status"] == "failed"],
            "skipped": [k for k, v in st.items() if v["status"] == "skipped"]}


def verdict(goal: Goal, value: float | None, mode: str, cpus: int | None) -> str:
    """met / not met / not measured (and why)."""
    if mode != "full":
        return "not measured (smoke: tiny sizes on the CPU)"
    if value is None:
        return "not measured (a stage it needs did not run: see the table)"
    if goal.cpus is not None and cpus != goal.cpus:
        return f"not measured ({cpus} usable CPUs; the goal is for {goal.cpus})"
    return "met" if value >= goal.target else "not met"


def describe(name: str, e: dict[str, Any]) -> str:
    """One readable line for a stage's entry."""
    if e["status"] == "failed":
        return f"FAILED {e['error']['type']}: {(e['error']['message'].splitlines() or [''])[0][:160]}"
    if e["status"] != "ok":
        return f"{e['status'].upper()}: {e.get('reason', '')}"
    unit = "images" if "images_per_s" in e else "texts" if "texts_per_s" in e else None
    if unit:
        steady = f" (steady {e['steady_per_s']:,.1f})" if e.get("steady_per_s") else ""
        busy = f", model busy {e['model_busy']:.0%}" if e.get("model_busy") is not None else ""
        peak = f", peak GPU {e['peak_gpu_bytes'] / 2**30:.1f} GiB" if e.get("peak_gpu_bytes") else ""
        done = f", {e['encoded']} encoded" if "encoded" in e else ""
        batch = f", batch {e['batch_size']}" if e.get("batch_size") else ""
        return f"{e[unit + '_per_s']:10,.1f} {unit}/s{steady}{busy}{peak}{done}{batch}{agreed(e)} ({e['seconds']:.1f} s)"
    if name == "facts":
        v = e["versions"]
        return (f"{e['gpu'] or 'no GPU'}, {e['cpus']} usable CPUs, torch {v['torch']}, transformers "
                f"{v['transformers']}, torchvision {v['torchvision']}")
    if name == "jpegs":
        return (f"{e['unique']} unique JPEGs ({', '.join(e['sizes'])}) q{e['quality']}, {e['mean_kib']} KiB each, "
                f"as {e['rows']} rows ({e['seconds']:.1f} s)")
    return f"ok ({e['seconds']:.1f} s)"


def agreed(e: dict[str, Any]) -> str:
    """", vectors agree with ...: least cosine ..." for a stage that compared vectors."""
    if not e.get("agreement"):
        return ""
    worst = min(v["min"] for v in e["agreement"].values())
    other = max(v["other_ids_median"] for v in e["agreement"].values())
    names = ", ".join(k.replace("mmenc_b16_", "").replace("_b16", "") for k in e["agreement"])
    return f"; vectors agree ({names}): least cosine {worst:.4f} (other items: {other:.2f})"


def report(mode: str, device: str, dtype: str, batch: int, elapsed: float, json_path: str, logs: str,
           stages: dict[str, dict[str, Any]], cpus: int | None) -> int:
    """The table, the ratios and each goal's figure and verdict; the exit status (1: a stage failed)."""
    s = summary(stages, mode, cpus)
    n, pct, x = s["numbers"], (lambda v: "n/a" if v is None else f"{v:.0%}"), (lambda v: "n/a" if v is None else f"{v:.2f}x")
    print(f"\nmmenc GPU benchmark ({mode}: {device}, {dtype}, batch {batch}), {elapsed:.0f} s since start; "
          f"JSON: {json_path}")
    for name, entry in stages.items():
        print(f"  {name:24s} {describe(name, entry)}")
    print(f"  of the forward-only limit, whole run (excluding model load): B/16 gpu {pct(n['b16_gpu_share_whole_run'])}, "
          f"B/16 fast {pct(n['b16_fast_share_whole_run'])}, L/14 {pct(n['l14_share_whole_run'])}; steady texts / "
          f"sentence-transformers {x(n['texts_ratio_steady'])}; B/16 fast / DataLoader baseline (both steady) "
          f"{x(n['b16_fast_vs_baseline'])}; mmenc's default batch size / batch {batch} {pct(n['b16_default_batch_share'])}")
    print("goals (one H100, 16 cores):")
    for g in s["goals"]:
        share = g["target"] <= 1
        value = (pct if share else x)(g["value"])
        print(f"  {g['goal']:68s} {value:>6s} (goal {pct(g['target']) if share else x(g['target'])})  {g['verdict']}")
    for what in ("skipped", "failed"):
        if s[what]:
            print(f"{what.upper()}: {', '.join(s[what])} (reasons in the JSON; logs in {logs})")
    return 1 if s["failed"] else 0
