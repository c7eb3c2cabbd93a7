"""`mmenc inspect OUT`: every shard read and checked against the run's metadata and against the
SHA-256 of its files recorded at its commit, what is damaged in the output, and its duplicates."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import OutputError
from .damage import output_problems
from .embeddings import check_token_shard, is_token_shard, read_shard, shard_meta
from .keys import file_sha256
from .layout import parse_shard_name
from .outdir import OutDir, open_output
from .status import find_duplicates


@dataclass
class InspectReport:
    """What `mmenc inspect` found: counts, facts and problems (a non-empty `problems` fails)."""

    embeddings: int = 0
    by_modality: dict[str, int] = field(default_factory=dict)
    dim: int | None = None
    dtype: str | None = None
    model: str | None = None
    revision: str | None = None
    format: str | None = None
    shards: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    duplicates: Any = None  # `status.Duplicates`: ids or items committed twice (exit 4)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        from dataclasses import asdict

        return asdict(self)


def inspect_output(out: str | Path) -> InspectReport:
    """Read every shard, check it is readable, agrees with the run metadata and, where its record
    holds them, that its files' bytes are those committed (their SHA-256)."""
    od = open_output(out)
    report = InspectReport()
    run = od.read_run_meta()
    run = run if isinstance(run, dict) else {}
    facts = run.get("facts") or {}
    report.dim, report.model = facts.get("dim"), facts.get("model")
    report.revision, report.dtype = facts.get("revision"), facts.get("out_dtype")
    report.format = (run.get("config", {}).get("writer") or {}).get("format")
    if not od.root.is_dir():
        raise OutputError(f"{od.root}: no such output folder")
    exists = od.run_meta_path.exists()
    if not exists and not od.shards():
        raise OutputError(f"{od.root} is not an mmenc output: it holds no {od.run_meta_path.name} and no shards")
    if not exists:
        report.problems.append(f"{od.run_meta_path}: missing run metadata (not an mmenc output?)")
    report.problems += [p for p in output_problems(od) if exists or not p.startswith(str(od.run_meta_path))]
    sums: dict[str, dict[str, str]] = {}
    report.duplicates = find_duplicates(od, [], sums=sums)  # damaged shards are named below
    for shard in od.shards():
        entry: dict[str, Any] = {"name": shard.name, "rows": 0, "ok": True}
        mismatch = _verify(od, shard, sums.get(shard.name) or {}, entry)
        try:
            _read(od, shard, facts, report, entry)
        except Exception as exc:  # any unreadable shard is a finding, not a crash
            entry["ok"] = False
            entry["error"] = f"{type(exc).__name__}: {exc}"
            if mismatch is None:  # a shard whose bytes changed is named once, for that
                report.problems.append(f"{shard.name}: {entry['error']}")
        if mismatch is not None:
            entry["ok"], entry["error"] = False, mismatch
            report.problems.append(mismatch)
        parsed = parse_shard_name(shard.name)
        entry["task"] = parsed.task if parsed else None
        report.shards.append(entry)
    return report


def _read(od: OutDir, shard: Any, facts: dict[str, Any], report: InspectReport, entry: dict[str, Any]) -> None:
    """Read one shard, count its rows into `report` and check it agrees with the run's facts
    (ValueError, or the reader's own error, when it does not)."""
    meta = shard_meta(shard)
    if is_token_shard(od, shard):
        ids, mods, dim = check_token_shard(od, shard, facts)
        matrix = np.broadcast_to(np.float32(0), (len(ids), dim or 0))  # shape only (no memory)
    else:
        ids, mods, matrix = read_shard(od, shard, None)
    entry["rows"] = len(ids)
    for m in mods:
        report.by_modality[m] = report.by_modality.get(m, 0) + 1
    report.embeddings += len(ids)
    dim = int(matrix.shape[1]) if matrix.size else meta.get("dim")
    if report.dim is None:
        report.dim = dim
    if dim is not None and report.dim is not None and dim != report.dim:
        raise ValueError(f"dim {dim} differs from the run's dim {report.dim}")
    if meta and facts and meta.get("model") != facts.get("model"):
        raise ValueError(f"model {meta.get('model')!r} differs from the run's {facts.get('model')!r}")
    if len(ids) != len(mods) or (matrix.size and matrix.shape[0] != len(ids)):
        raise ValueError("row counts of ids and embeddings differ")


def _verify(od: OutDir, shard: Any, sums: dict[str, str], entry: dict[str, Any]) -> str | None:
    """Hash a shard's file and its side file (sidecar or index) and compare them with the SHA-256
    recorded at its commit (`sums`); what differs, named with what to do (None: they agree, or
    none was recorded: an earlier mmenc's shard, or one whose record was rebuilt from the shard).
    `entry["checksum"]` says which: "ok", "differs", "unreadable" or None."""
    entry["checksum"] = None
    files = {"shard": shard}
    if "side" in sums:
        files["side"] = od.index_path(shard.name) if is_token_shard(od, shard) else od.sidecar_path(shard.name)
    for key, expected in sorted(sums.items(), key=lambda kv: kv[0] != "shard"):
        path = files.get(key)
        if path is None:
            continue
        try:
            found = file_sha256(path)
        except Exception:  # unreadable: the read that follows names it
            entry["checksum"] = "unreadable"
            return None
        if found != expected:
            entry["checksum"] = "differs"
            what = "its bytes differ" if key == "shard" else f"its {path.parent.name} file {path.name} differs"
            return (f"shard {shard.name}: {what} from those committed (SHA-256 {found[:16]}, recorded "
                    f"{expected[:16]}): it is damaged; delete it and re-run its task to encode its items again")
        entry["checksum"] = "ok"
    return None


# ------------------------------------------------------------------------------ token outputs
