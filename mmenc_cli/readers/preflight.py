"""The inputs checked before a model is loaded for nothing: every input exists and has a known
format (`plan`), and the keys a run reads name fields that its rows hold.

A key that names nothing would make every row of an input invalid or empty: millions of error rows
for a typo. So the id key (given or the format's default), an image, text, audio or video key that
was given explicitly, and every `--keep` field must be held by at least one of the first `SAMPLE`
records of each input as given (its first source: the first file a pattern matches); a key no such
record holds is a `ManifestError` (exit 3) naming the input and the fields its records do hold.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..config import ManifestConfig
from ..errors import ManifestError
from .plan import plan
from .registry import SPREAD, Part, Source

#: records of each input looked at for the fields its rows hold
SAMPLE = 1000


def preflight(inputs: Sequence[str], cfg: ManifestConfig) -> list[Source]:
    """The planned sources of `inputs`, as `plan(inputs)` lays them out, once each input's keys
    are checked (see the module docstring). ManifestError for a missing input, an unknown format,
    or a key that names nothing."""
    sources: list[Source] = []
    for given in inputs:
        base = sources[-1].start + sources[-1].size if sources else 0
        own = [replace(s, start=s.start + base) for s in plan([given])]
        if own:
            check_keys(given, own[0], cfg)
        sources += own
    return sources


def _wanted(src: Source, cfg: ManifestConfig) -> list[tuple[str, str]]:
    """(what, key) of each key the run reads from `src` that must name a field: the id key, the
    media and text keys given as options (and used by the format), the kept fields."""
    keys = src.fmt.keys(cfg)
    wanted = [("--id-key" if cfg.id_key else "the id key", keys.id)]
    for option, given, used in (("--image-key", cfg.image_key, keys.image), ("--text-key", cfg.text_key, (keys.text,)),
                                ("--audio-key", cfg.audio_key, keys.audio), ("--video-key", cfg.video_key, keys.video)):
        if given and used == (given,):
            wanted.append((option, given))
    return wanted + [("--keep", field) for field in keys.keep]


def _all_of(src: Source) -> Part:
    """The part of `src` that is all of it, for its kind of slicing."""
    if src.fmt.slicing == SPREAD:
        return Part(pick=(0, 1))
    return Part() if src.fmt.taken_whole(src) else Part(0, src.size)


def check_keys(given: str, src: Source, cfg: ManifestConfig) -> None:
    """ManifestError when a key the run reads is held by none of `src`'s first `SAMPLE` records."""
    seen: set[str] = set()
    count = 0
    for record in src.fmt.records(src, cfg, _all_of(src)):
        if count >= SAMPLE:
            break
        if isinstance(record, tuple) and isinstance(record[2], dict):
            seen.update(str(k) for k in record[2])
            count += 1
    if not count:
        return  # no record to judge by (an empty input; damaged records are error rows of their own)
    missing = [(what, key) for what, key in _wanted(src, cfg) if key not in seen]
    if missing:
        named = "; ".join(f'{what} "{key}"' for what, key in missing)
        held = ", ".join(sorted(seen)[:40]) or "none"
        where = given if src.path == given else f"{given} ({src.path})"
        hint = "" if cfg.id_key or missing[0][0] != "the id key" else "; --id-key names the field that holds the id"
        raise ManifestError(f"{where}: no row of its first {count} holds {named}; its rows hold: {held}{hint}")


__all__ = ["SAMPLE", "check_keys", "preflight"]
