"""Write the fault corpus of the test suite, with a manifest, for before/after output comparisons.

    python benchmarks/proof_corpus.py DIR

writes into DIR the broken media of `tests/faults.build_fault_corpus`, the valid but unusual media
of `tests/faults.build_good_corpus`, and `DIR/manifest.jsonl`: one row per case (image rows, an
image+text pair every third row), plus rows that are not valid rows (bad JSON, no id, a duplicate
id, an empty text, wrong types). Encode it, and `samples/manifest.jsonl`, with the same model and
options before and after a change, then compare the outputs with `benchmarks/compare_outputs.py`.

The corpus is written once and reused for both runs: the "refused" case names a free loopback
port chosen when the corpus is written, which the error message repeats. Encode with
`--fetch-retries 0 --fetch-timeout 2` so that case fails fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.faults import build_fault_corpus, build_good_corpus  # noqa: E402


def write_corpus(root: Path) -> Path:
    """Write the media and the manifest into `root`; return the manifest's path."""
    root.mkdir(parents=True, exist_ok=True)
    faults = {name: case.source for name, case in build_fault_corpus(root).items()}
    goods = build_good_corpus(root)
    lines: list[str] = []
    for i, (name, source) in enumerate(sorted({**faults, **goods}.items())):
        row = {"id": name, "image": source}
        if i % 3 == 0:
            row["text"] = f"a picture called {name.replace('_', ' ')}"
        lines.append(json.dumps(row))
    lines += [
        '{"id": "bad-json", "text": ',
        json.dumps({"text": "a row without an id"}),
        json.dumps({"id": "webp", "text": "a duplicate id"}),
        json.dumps({"id": "blank-text", "text": "   "}),
        json.dumps({"id": ["a", "list"], "text": "an id of the wrong type"}),
        json.dumps({"id": "text-number", "text": 42}),
        json.dumps({"id": "neither"}),
        json.dumps({"id": 7, "text": "an integer id"}),
        "[1, 2, 3]",
    ]
    manifest = root / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return manifest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/proof_corpus.py DIR")
    print(write_corpus(Path(sys.argv[1])))
