"""Compare two mmenc outputs: the same embeddings, the same error rows, the same counts.

    python benchmarks/compare_outputs.py A B

Reads both folders with pyarrow and json only (no mmenc code, so it judges a change to mmenc
without trusting it): every Parquet shard's (id, modality) -> embedding, every error-report row
with its `time` left out, and the per-modality counts of each task's metadata. Prints max |diff|
over the embeddings both hold, what only one holds, and the error rows only one holds; exits 1
when anything differs (an embedding by more than --tolerance, 0 by default).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

IGNORED_ERROR_FIELDS = ("time",)
COUNTED = ("requested", "encoded", "encoded_before", "failed", "failed_before", "skipped", "truncated")


def embeddings(out: Path) -> dict[tuple[str, str], np.ndarray]:
    """(id, modality) -> float32 vector of every Parquet shard at the top of `out`."""
    import pyarrow.parquet as pq

    found: dict[tuple[str, str], np.ndarray] = {}
    for shard in sorted(out.glob("part-*.parquet")):
        table = pq.read_table(shard, columns=["id", "modality", "embedding"])
        emb = table.column("embedding").combine_chunks()
        matrix = emb.values.to_numpy(zero_copy_only=False).reshape(-1, emb.type.list_size).astype(np.float32)
        for key, vec in zip(zip(table.column("id").to_pylist(), table.column("modality").to_pylist()), matrix):
            if key in found:
                raise SystemExit(f"{out}: {key} is in more than one shard")
            found[key] = vec
    return found


def error_rows(out: Path) -> list[str]:
    """Every error-report row as canonical JSON, without the fields that change run to run."""
    rows = []
    for path in sorted((out / "_mmenc" / "errors").glob("errors-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                for name in IGNORED_ERROR_FIELDS:
                    row.pop(name, None)
                rows.append(json.dumps(row, sort_keys=True))
    return sorted(rows)


def counts(out: Path) -> dict[str, Any]:
    """Rows, invalid lines and per-modality counts summed over the task metadata files."""
    total: dict[str, Any] = {"rows": 0, "invalid": 0}
    for path in sorted((out / "_mmenc" / "tasks").glob("task-*.json")):
        c = json.loads(path.read_text(encoding="utf-8"))["counters"]
        total["rows"] += c["rows"]
        total["invalid"] += c["invalid"]
        for mod, m in sorted(c["modalities"].items()):
            for name in COUNTED:
                value = m[name]
                value = sum(value.values()) if isinstance(value, dict) else value
                total[f"{mod}.{name}"] = total.get(f"{mod}.{name}", 0) + value
    return total


def compare(a: Path, b: Path, tolerance: float) -> bool:
    """Print the comparison; True when the outputs agree."""
    same = True
    ea, eb = embeddings(a), embeddings(b)
    both = sorted(set(ea) & set(eb))
    diff = max((float(np.abs(ea[k] - eb[k]).max()) for k in both), default=0.0)
    only_a, only_b = sorted(set(ea) - set(eb)), sorted(set(eb) - set(ea))
    print(f"embeddings: {len(ea)} in A, {len(eb)} in B, {len(both)} in both; max |diff| {diff:.3g}")
    if only_a or only_b or diff > tolerance:
        same = False
        print(f"  DIFFERENT: only in A {only_a[:5]}, only in B {only_b[:5]}, tolerance {tolerance:g}")
    ra, rb = error_rows(a), error_rows(b)
    extra_a = sorted(set(ra) - set(rb))
    extra_b = sorted(set(rb) - set(ra))
    print(f"error rows: {len(ra)} in A, {len(rb)} in B (ignoring {', '.join(IGNORED_ERROR_FIELDS)})")
    if ra != rb:
        same = False
        for row in extra_a[:5]:
            print(f"  only in A: {row}")
        for row in extra_b[:5]:
            print(f"  only in B: {row}")
    ca, cb = counts(a), counts(b)
    print(f"counts: {json.dumps(ca, sort_keys=True)}")
    if ca != cb:
        same = False
        print(f"  DIFFERENT in B: {json.dumps(cb, sort_keys=True)}")
    print("same" if same else "DIFFERENT")
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.0, help="largest |diff| still called the same")
    args = ap.parse_args()
    sys.exit(0 if compare(args.a, args.b, args.tolerance) else 1)


if __name__ == "__main__":
    main()
