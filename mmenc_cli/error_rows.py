"""Reading an output's error report back for `mmenc errors`: each item's latest outcome, filters,
summaries, and the rows `errors retry` writes for the failed items."""

from __future__ import annotations

import base64
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

from .config import DEFAULT_MAX_ROW_BYTES
from .errors import ManifestError, OutputError, printable
from .idset import HashSet64, id_hash
from .output import OutDir, iter_shard_keys, open_output
from .output.fs import LOCAL
from .output.report import iter_error_records, row_locator
from .readers import format_of, read_raw_row
from .records import MODALITIES


def json_line(obj: Any) -> str:
    """One line of JSON with non-ASCII text kept, lone surrogates (ids or paths that are not valid
    Unicode) escaped as \\udXXX: always writable as UTF-8, and read back to the same strings."""
    return printable(json.dumps(obj, ensure_ascii=False))


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    if row.get("modality") is None:
        return ("line", row.get("manifest"), row_locator(row))
    return ("item", row.get("id"), row.get("modality"))


def latest_errors(out: "str | Path | OutDir", damaged: list[str] | None = None) -> list[dict[str, Any]]:
    """The current failures of an output: latest row per item, minus items encoded since and
    manifest lines a later run read as valid rows (a "resolved" marker). Report lines and shards
    that cannot be read are skipped (named in `damaged` when given)."""
    od = open_output(out)
    if not od.root.is_dir():
        raise OutputError(f"{od.root}: no such output folder")
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


def retry_rows(out: "str | Path | OutDir", rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Rebuild the manifest rows of failed items: absolute media paths (inline bytes, a tar's
    members included, as data URIs), kept fields, and only the failed modalities' fields. A row of a
    manifest keeps its own fields; a sample of a tar shard or a folder becomes a JSONL row under the
    keys `--id-key`/`--image-key`/`--text-key`/`--audio-key`/`--video-key` name (`id`, `image`,
    `text`, `audio`, `video` by default): the input's format says which (`Format.rewritten`), how
    its record is found (`Format.keyed`) and where its relative media paths start. Invalid lines
    are skipped."""
    from .config import ManifestConfig

    run = open_output(out).read_run_meta()
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


def write_retry(out: "str | Path | OutDir", rows: list[dict[str, Any]], path: Path) -> int:
    """Write the retry manifest of `rows` (`retry_rows`) to `path`, whole or not at all; the rows written."""
    written = 0

    def write(tmp: Path) -> None:
        nonlocal written
        with open(tmp, "w", encoding="utf-8") as fh:
            for row in retry_rows(out, rows):
                fh.write(json_line(row) + "\n")
                written += 1

    LOCAL.publish(Path(path), write)
    return written


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
