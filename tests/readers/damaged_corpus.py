"""A corpus of damaged Arrow and Parquet inputs (seeded random byte corruptions of small, valid
files) and a worker that reads each in a subprocess, so a crash of the reader (a segfault) is a
result, not a dead test run.

Each result says how reading ended ("ok", "manifest_error" for a run-level ManifestError, or
"crash: ..."), and which of the file's rows no row, invalid row or error row accounts for.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROWS = 24  # rows of each base file, in record batches or row groups of 5
ROOT = Path(__file__).resolve().parents[2]


def png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (seed * 40 % 256, 90, 200)).save(buf, "PNG")
    return buf.getvalue()


def base_files(root: Path) -> dict[str, Path]:
    """The valid inputs: an IPC file, an IPC stream, a Parquet file with row groups, and (when
    `datasets` is installed) a saved dataset with an Image feature."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"id": [f"r{i}" for i in range(ROWS)], "text": [f"caption {i} é" for i in range(ROWS)],
                      "image": pa.array([{"bytes": png(i), "path": f"p{i}.png"} for i in range(ROWS)], image)})
    out = {}
    with pa.OSFile(str(root / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):
            writer.write_batch(batch)
    with pa.OSFile(str(root / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):
            writer.write_batch(batch)
    pq.write_table(table, root / "rows.parquet", row_group_size=5)
    out.update({"file": root / "file.arrow", "stream": root / "stream.arrow", "parquet": root / "rows.parquet"})
    try:
        import datasets
        from PIL import Image
    except ImportError:
        return out
    features = datasets.Features({"id": datasets.Value("string"), "image": datasets.Image(),
                                  "text": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"id": table["id"].to_pylist(), "text": table["text"].to_pylist(),
                                     "image": [Image.open(io.BytesIO(png(i))) for i in range(ROWS)]},
                                    features=features)
    ds.save_to_disk(str(root / "saved"), max_shard_size=None)
    out["saved"] = root / "saved"
    return out


def corrupt(data: bytes, rng: random.Random) -> bytes:
    """1 to 16 bytes changed: flipped at scattered places, or a run overwritten at one place."""
    buf = bytearray(data)
    n = rng.randint(1, 16)
    if rng.random() < 0.5:
        for _ in range(n):
            i = rng.randrange(len(buf))
            buf[i] ^= rng.randint(1, 255)
    else:
        i = rng.randrange(len(buf) - n)
        buf[i:i + n] = bytes(rng.randrange(256) for _ in range(n))
    return bytes(buf)


def variants(root: Path, count: int, seed: int = 7) -> list[dict[str, Any]]:
    """`count` damaged copies of the base files, in turn; each: the input to read and its file."""
    bases = base_files(root / "base")
    rng = random.Random(seed)
    out = []
    for v in range(count):
        kind = sorted(bases)[v % len(bases)]
        base = bases[kind]
        if base.is_dir():  # damage the saved dataset's one data file
            target = root / f"v{v:03d}"
            shutil.copytree(base, target)
            data = next(target.glob("*.arrow"))
            data.write_bytes(corrupt(data.read_bytes(), rng))
            out.append({"input": str(target), "file": str(data), "kind": kind})
        else:
            target = root / f"v{v:03d}{base.suffix}"
            target.write_bytes(corrupt(base.read_bytes(), rng))
            out.append({"input": str(target), "file": str(target), "kind": kind})
    return out


def read_all(jobs: list[dict[str, Any]], target: str = "worker", timeout: float = 300) -> list[dict[str, Any]]:
    """Each job done by `target` (`worker`: read; `run_worker`: encode) in a subprocess; a
    subprocess that dies (a signal) marks the job it was on as crashed, and a new one goes on
    with the rest."""
    results: list[dict[str, Any]] = []
    while len(results) < len(jobs):
        rest = jobs[len(results):]
        proc = subprocess.run([sys.executable, "-c", f"from tests.readers.damaged_corpus import {target}; {target}()"],
                              input=json.dumps(rest), capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        results += done
        if proc.returncode != 0 and len(results) < len(jobs):
            crash = {"outcome": f"crash: exit {proc.returncode}", "exit": proc.returncode, "stderr": proc.stderr[-500:]}
            results.append({**rest[len(done)], "uncovered": [], **crash})
    return results


def run_all(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`read_all` with each job encoded (`run_worker`), its output in the job's "out"."""
    return read_all(jobs, "run_worker")


def worker() -> None:
    """Read each job on stdin (a JSON list) and print one JSON result line per job."""
    for job in json.loads(sys.stdin.read()):
        print(json.dumps({**job, **_read(job)}), flush=True)


def _read(job: dict[str, Any]) -> dict[str, Any]:
    from mmenc_cli.config import ManifestConfig
    from mmenc_cli.errors import ManifestError
    from mmenc_cli.readers import iter_rows, read_raw_row
    from mmenc_cli.records import InvalidRow, ManifestRow

    try:
        rows = list(iter_rows([job["input"]], ManifestConfig()))
        shares = [list(iter_rows([job["input"]], ManifestConfig(), i, 2)) for i in range(2)]
        for row in rows:  # what `mmenc errors retry` does with a row that failed later
            if isinstance(row, ManifestRow):
                try:
                    read_raw_row(row.manifest, row.offset, key=row.key)
                except ManifestError:
                    pass
    except ManifestError as exc:
        return {"outcome": "manifest_error", "message": str(exc), "uncovered": []}
    except Exception as exc:  # noqa: BLE001 - the point is to see every other way reading ends
        return {"outcome": f"crash: {type(exc).__name__}: {exc}", "uncovered": []}
    whole, parts = _coverage(rows), _coverage([r for share in shares for r in share])
    return {"outcome": "ok", "uncovered": sorted(set(range(ROWS)) - set(whole)),
            "twice": sorted(i for i, n in whole.items() if n > 1), "split_differs": whole != parts,
            "errors": [r.error.reason for r in rows if isinstance(r, InvalidRow)],
            "valid": sum(isinstance(r, ManifestRow) for r in rows)}


def _coverage(rows: list[Any]) -> Counter[int]:
    """How many times each row index is accounted for: a row, an invalid row, or an error row's range."""
    from mmenc_cli.records import InvalidRow

    seen: Counter[int] = Counter()
    for r in rows:
        if isinstance(r, InvalidRow) and r.error.reason == "manifest.bad_shard":
            seen.update(range(r.offset, ROWS) if "on (" in r.error.message else
                        range(r.offset, r.offset + _count(r.error.message)))
        else:
            seen[r.offset] += 1
    return seen


def _count(message: str) -> int:
    """How many rows a bad_shard message of `batches.lost_rows` covers."""
    import re

    m = re.search(r"cannot be read rows (\d+) to (\d+)", message)
    if m:
        return int(m.group(2)) - int(m.group(1)) + 1
    return 1 if re.search(r"cannot be read row \d+ ", message) else ROWS


def run_worker() -> None:
    """Encode each job on stdin with the fake encoder; print its exit code (as the CLI would end)
    and whether every row the reader gave ends as an embedding or an error row."""
    from mmenc_cli.cli.exits import exit_code_for
    from mmenc_cli.config import ManifestConfig
    from mmenc_cli.readers import iter_rows
    from mmenc_cli.records import ManifestRow
    from mmenc_cli.run.pipeline import run_encode
    from tests.fakes import FakeEncoder, factory
    from tests.runs import embeddings, error_rows, make_cfg

    for job in json.loads(sys.stdin.read()):
        out = Path(job["out"])
        try:
            res = run_encode(make_cfg([Path(job["input"])], out), encoder_factory=factory(FakeEncoder()))
            code, balanced = 0, res.counters.balanced
        except Exception as exc:  # noqa: BLE001 - mapped to its exit code as the CLI maps it
            code, balanced = exit_code_for(exc), True
        lost = []
        if code == 0:
            done = {i for i, _ in embeddings(out)} | {r.get("id") for r in error_rows(out)}
            lost = [r.id for r in iter_rows([job["input"]], ManifestConfig())
                    if isinstance(r, ManifestRow) and r.id not in done]
        print(json.dumps({**job, "exit": code, "balanced": balanced, "lost": lost}), flush=True)
    # every result is out; the runs' threads meeting torch's at interpreter exit are not what is checked
    os._exit(0)
