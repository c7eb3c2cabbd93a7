"""The error report: JSON lines under `OUT/_mmenc/errors/`, one file per task and worker.

Writing: `ErrorReportWriter` appends one `ErrorRecord` per failure and flushes it, so a kill loses
none. Reading (`mmenc errors ...`): an item's latest outcome wins: an item that failed and was
later encoded (it is in a committed shard) is resolved and no longer counted; an item that failed
several times counts once, with its latest error. Lines that were never valid rows (modality null)
are keyed by manifest+offset.
"""

from __future__ import annotations

import base64
import functools
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from .clock import timestamp
from .config import DEFAULT_MAX_ROW_BYTES
from .errors import ManifestError, MMError, OutputError, printable, trim_message
from .idset import HashSet64, id_hash
from .outdir import OutDir, iter_shard_keys
from .readers import format_of, read_raw_row
from .records import MODALITIES


@dataclass(slots=True)
class ErrorRecord:
    """One row of the error report. `offset` is what `mmenc errors retry` uses to find the row."""

    id: str | None
    manifest: str | None
    line: int | None
    offset: int | None
    modality: str | None
    stage: str
    code: int
    reason: str
    error: str
    message: str
    source: str | None = None
    attempt: int = 1
    time: str = field(default_factory=timestamp)
    task: int = 0
    status: str = "failed"  # "failed", or "resolved": a marker that a manifest line invalid before is a row now
    key: str | None = None  # a folder's sample: its relative path (its offset is its place in the walk, which moves)

    @classmethod
    def from_error(cls, err: MMError, *, id: str | None, manifest: str | None, line: int | None,
                   offset: int | None, modality: str | None, source: str | None = None,
                   attempt: int = 1, task: int = 0, key: str | None = None) -> "ErrorRecord":
        """Build a report row from an `MMError` and where the item came from."""
        return cls(id=id, manifest=manifest, line=line, offset=offset, modality=modality,
                   stage=err.stage, code=err.code, reason=err.reason, error=err.error,
                   message=trim_message(err.message), source=source, attempt=attempt, task=task, key=key)

    @classmethod
    def resolved(cls, *, id: str, manifest: str, line: int | None, offset: int | None, task: int,
                 key: str | None = None) -> "ErrorRecord":
        """A marker: the manifest line at (manifest, offset or key), invalid in an earlier run, is a
        valid row now; the errors commands no longer count the earlier failure."""
        return cls(id=id, manifest=manifest, line=line, offset=offset, modality=None, stage="read", code=0,
                   reason="resolved", error="", message="this manifest line is a valid row now", task=task,
                   status="resolved", key=key)

    def to_json(self) -> str:
        """One JSON line (no trailing newline)."""
        return json.dumps(asdict(self))  # ASCII: lone surrogates round-trip


class ErrorReportWriter:
    """Append-only JSON-lines writer for one (task, worker). Flushes every row so a kill loses none.

    A torn last line (a writer killed, or out of space, in the middle of a row) is cut off when
    the report is opened again, so the next row never joins it. A failed write is a fault of the
    output (`OutputError`): the run ends.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.count = 0
        self.broken = False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            cut_torn_tail(path)
            self._fh = open(path, "ab")
        except OSError as exc:
            raise self._fault(exc) from exc

    def _fault(self, exc: OSError) -> OutputError:
        self.broken = True
        return OutputError(f"cannot write the error report {self.path}: {exc.strerror or exc}; "
                           "free the space or fix the permissions, then run the same command")

    def write(self, record: ErrorRecord) -> None:
        """Append one row and flush it to the OS."""
        if self.broken:
            raise OutputError(f"the error report {self.path} could not be written earlier")
        try:
            self._fh.write((record.to_json() + "\n").encode("ascii"))
            self._fh.flush()
        except OSError as exc:
            raise self._fault(exc) from exc
        self.count += 1

    def sync(self) -> None:
        """fsync the report (at shard commits and at the end of the run)."""
        if self.broken:
            return
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as exc:
            raise self._fault(exc) from exc

    def close(self) -> None:
        """Flush, fsync and close (after a fault, just close)."""
        if self._fh.closed:
            return
        try:
            self.sync()
        finally:
            try:
                self._fh.close()
            except OSError:  # the fault was raised already
                pass

    def __enter__(self) -> "ErrorReportWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:  # do not hide the error that ends the run behind a second one
            try:
                self.close()
            except OutputError:
                pass
            return
        self.close()


def cut_torn_tail(path: Path) -> int:
    """Cut a last line that has no newline (a row the writer could not finish) off a report;
    return the bytes removed."""
    try:
        fh = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with fh:
        size = fh.seek(0, os.SEEK_END)
        end, keep = size, size
        while end > 0:
            start = max(0, end - (1 << 16))
            fh.seek(start)
            chunk = fh.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                return 0
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end, keep = start, 0
        fh.truncate(keep)
        return size - keep


def iter_error_records(paths: Iterable[Path], damaged: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """Read raw report rows from many report files. A torn last line (a killed writer's) is
    skipped; a complete line that is not a JSON row (invalid UTF-8, garbage) is skipped and, when
    `damaged` is given, named there."""
    for path in paths:
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            continue
        with fh:
            for number, raw in enumerate(fh, 1):
                text = raw.strip()
                if not text:
                    continue
                try:
                    row = json.loads(text.decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as exc:
                    if raw.endswith(b"\n") and damaged is not None:
                        damaged.append(f"{path}: line {number} is not a report row ({type(exc).__name__})")
                    continue
                if isinstance(row, dict):
                    yield row
                elif damaged is not None:
                    damaged.append(f"{path}: line {number} is not a report row (a JSON {type(row).__name__})")


def json_line(obj: Any) -> str:
    """One line of JSON with non-ASCII text kept, lone surrogates (ids or paths that are not valid
    Unicode) escaped as \\udXXX: always writable as UTF-8, and read back to the same strings."""
    return printable(json.dumps(obj, ensure_ascii=False))


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    if row.get("modality") is None:
        return ("line", row.get("manifest"), row_locator(row))
    return ("item", row.get("id"), row.get("modality"))


def row_locator(row: dict[str, Any]) -> str:
    """Where an error row's record is in its input (as `ManifestRow.locator`): its `key`, else its
    offset. A row written before folders were keyed has no `key` field: for a folder's sample its
    id, the relative path, stands in for its place in the walk (which moves)."""
    if "key" in row:
        return str(row["key"]) if row["key"] is not None else str(row.get("offset"))
    if row.get("id") is not None and _is_folder(str(row.get("manifest"))):
        return str(row["id"])
    return str(row.get("offset"))


@functools.lru_cache(maxsize=1024)
def _is_folder(manifest: str) -> bool:
    from .readers import files

    found = files.info(manifest)
    return found.exists and found.is_dir


def latest_errors(out: str | Path, damaged: list[str] | None = None) -> list[dict[str, Any]]:
    """The current failures of an output: latest row per item, minus items encoded since and
    manifest lines a later run read as valid rows (a "resolved" marker). Report lines and shards
    that cannot be read are skipped (named in `damaged` when given)."""
    od = OutDir(out)
    latest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in iter_error_records(od.error_report_paths(), damaged):
        key = _key(row)
        old = latest.get(key)
        if old is None or (int(row.get("attempt") or 1), str(row.get("time"))) >= (int(old.get("attempt") or 1), str(old.get("time"))):
            latest[key] = row
    latest = {k: r for k, r in latest.items() if r.get("status", "failed") == "failed"}
    if not latest:
        return []
    done = HashSet64()
    for _shard, ids, mods in iter_shard_keys(od, damaged=[] if damaged is None else damaged):
        for i, m in zip(ids, mods):
            done.add(id_hash(i, m))
            done.add(id_hash(i))
    return [r for k, r in latest.items() if not _resolved(k, r, done)]


def _resolved(key: tuple[Any, ...], row: dict[str, Any], done: HashSet64) -> bool:
    """An item encoded since it failed; or a sample over --max-row-bytes encoded since (from `retry`)."""
    if key[0] == "item":
        return id_hash(row.get("id"), row.get("modality")) in done
    return row.get("reason") == "manifest.row_too_large" and row.get("id") is not None and id_hash(row["id"]) in done


def filter_errors(rows: Iterable[dict[str, Any]], code: list[int] | None = None, reason: list[str] | None = None,
                  stage: list[str] | None = None, modality: list[str] | None = None,
                  grep: str | None = None) -> list[dict[str, Any]]:
    """Rows matching every given filter (each filter a list of accepted values)."""
    out = []
    for r in rows:
        if code and int(r.get("code") or 0) not in code:
            continue
        if reason and r.get("reason") not in reason:
            continue
        if stage and r.get("stage") not in stage:
            continue
        if modality and (r.get("modality") or "none") not in modality:
            continue
        if grep and grep.lower() not in json.dumps(r, ensure_ascii=False).lower():
            continue
        out.append(r)
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts by code, reason, stage and modality, and one example message per (code, reason)."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        g = (r.get("code"), r.get("reason"), r.get("stage"), r.get("modality"))
        entry = groups.setdefault(g, {"code": g[0], "reason": g[1], "stage": g[2], "modality": g[3], "count": 0,
                                      "example": r.get("message"), "example_id": r.get("id")})
        entry["count"] += 1
    return {
        "errors": len(rows),
        "by_code": dict(Counter(str(r.get("code")) for r in rows)),
        "by_reason": dict(Counter(str(r.get("reason")) for r in rows)),
        "by_stage": dict(Counter(str(r.get("stage")) for r in rows)),
        "by_modality": dict(Counter(str(r.get("modality") or "none") for r in rows)),
        "by_task": dict(Counter(str(r.get("task", 0)) for r in rows)),
        "groups": sorted(groups.values(), key=lambda e: (-e["count"], str(e["code"]), str(e["reason"]))),
    }


_UNLIMITED = 1 << 62


def retryable_whole(row: dict[str, Any]) -> bool:
    """A row that is not an item's but that `retry` rebuilds anyway: a tar or folder sample over
    --max-row-bytes (its media are written inline; encode the retry with a larger --max-row-bytes)."""
    if row.get("modality") is not None or row.get("reason") != "manifest.row_too_large" or row.get("id") is None:
        return False
    try:
        return format_of(str(row.get("manifest"))).rewritten
    except ManifestError:  # the input is gone: nothing to rebuild
        return False


def retry_rows(out: str | Path, rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Rebuild the manifest rows of failed items: absolute media paths (inline bytes, a tar's
    members included, as data URIs), kept fields, and only the failed modalities' fields. A row of a
    manifest keeps its own fields; a sample of a tar shard or a folder becomes a JSONL row under the
    keys `--id-key`/`--image-key`/`--text-key`/`--audio-key`/`--video-key` name (`id`, `image`,
    `text`, `audio`, `video` by default): the input's format says which (`Format.rewritten`), how
    its record is found (`Format.keyed`) and where its relative media paths start. Invalid lines
    are skipped."""
    from .config import ManifestConfig

    run = OutDir(out).read_run_meta()
    given = ((run if isinstance(run, dict) else {}).get("config") or {}).get("manifest") or {}
    cfg = ManifestConfig(id_key=given.get("id_key"), image_key=given.get("image_key"),
                         text_key=given.get("text_key"), audio_key=given.get("audio_key"),
                         video_key=given.get("video_key"), keep=tuple(given.get("keep") or ()))
    by_row: dict[tuple[str, str], tuple[set[str], Any, int]] = {}
    for r in rows:
        if r.get("manifest") in (None, "") or r.get("offset") is None or not (r.get("modality") or retryable_whole(r)):
            continue
        wanted = {r["modality"]} if r.get("modality") else set(MODALITIES)
        entry = (set(), r.get("id"), int(r["offset"]))
        by_row.setdefault((r["manifest"], row_locator(r)), entry)[0].update(wanted)
    for (manifest, locator), (modalities, row_id, offset) in sorted(by_row.items()):
        fmt = format_of(manifest)
        keys = fmt.keys(cfg)
        whole = modalities == set(MODALITIES)  # a sample over --max-row-bytes: read it whatever its size
        raw = dict(read_raw_row(manifest, offset, key=locator if fmt.keyed else None,
                                limit=_UNLIMITED if whole else DEFAULT_MAX_ROW_BYTES))
        found = {m: next((k for k in cands if raw.get(k) is not None), cands[0]) for m, cands in keys.media}
        base = fmt.base_dir(manifest)
        if fmt.rewritten:
            named = {"image": cfg.image_key, "audio": cfg.audio_key, "video": cfg.video_key}
            written = {m: named[m] or m for m in found}
            raw = {cfg.id_key or "id": row_id, **{k: raw.get(k) for k in keys.keep},
                   **{written[m]: raw.get(k) for m, k in found.items()}, cfg.text_key or "text": raw.get(keys.text)}
            found, text_key, id_key = written, cfg.text_key or "text", cfg.id_key or "id"
        else:
            text_key, id_key = keys.text, keys.id
        for modality, key in found.items():
            if modality not in modalities:
                raw.pop(key, None)
            else:
                raw[key] = _absolute_media(raw.get(key), base)
        if "text" not in modalities:
            raw.pop(text_key, None)
        if isinstance(raw.get(id_key), int):
            raw[id_key] = str(raw[id_key])
        yield {k: _jsonable(v) for k, v in raw.items() if v is not None or not fmt.rewritten}


def _absolute_media(value: Any, base: str) -> Any:
    if isinstance(value, dict):  # Hugging Face {bytes, path}
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return _data_uri(bytes(value))
    if isinstance(value, str) and value and "://" not in value and not value.startswith("data:"):
        if "://" in base:  # a folder behind an fsspec URL
            return base.rstrip("/") + "/" + value
        return os.path.abspath(os.path.join(base, os.path.expanduser(value)))
    return value


def _jsonable(v: Any) -> Any:
    return _data_uri(bytes(v)) if isinstance(v, (bytes, bytearray)) else v


_MAGIC = {b"\x89PNG": "image/png", b"\xff\xd8": "image/jpeg", b"GIF8": "image/gif", b"BM": "image/bmp",
          b"II*": "image/tiff", b"MM\x00*": "image/tiff", b"fLaC": "audio/flac", b"OggS": "audio/ogg",
          b"ID3": "audio/mpeg", b"\xff\xfb": "audio/mpeg", b"\x1aE\xdf\xa3": "video/webm"}


def _media_type(data: bytes) -> str:
    """The media type of some bytes by their magic number (RIFF and ISO media by their brand)."""
    if data.startswith(b"RIFF"):
        return {b"WEBP": "image/webp", b"WAVE": "audio/wav", b"AVI ": "video/x-msvideo"}.get(data[8:12],
                                                                                          "application/octet-stream")
    if data[4:8] == b"ftyp":
        return "audio/mp4" if data[8:11] == b"M4A" else "video/mp4"
    return next((k for magic, k in _MAGIC.items() if data.startswith(magic)), "application/octet-stream")


def _data_uri(data: bytes) -> str:
    """Inline bytes as a data URI (the media type sniffed; the decoders tell formats by content anyway)."""
    return f"data:{_media_type(data)};base64," + base64.b64encode(data).decode()
