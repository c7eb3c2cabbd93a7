"""Validation: one raw record -> a `ManifestRow`, or an `InvalidRow` saying which key is wrong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from ..records import InvalidRow, ManifestRow

_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          list: "an array", dict: "an object", bytes: "bytes", type(None): "null"}


#: the image members a WebDataset sample may hold, in the order the first present one is taken
TAR_IMAGES = ("jpg", "jpeg", "png", "webp")
#: the same for audio and video members (by extension, as folders pick them up)
TAR_AUDIO = ("flac", "wav", "mp3", "opus", "ogg", "m4a")
TAR_VIDEO = ("mp4", "webm", "mkv", "mov")


@dataclass(frozen=True, slots=True)
class Keys:
    """Which record keys hold a row's id, image, audio and video (each the first present of its
    candidates), text and kept fields, resolved for one input format (`Format.keys`)."""

    id: str
    image: tuple[str, ...]
    text: str
    keep: tuple[str, ...] = ()
    audio: tuple[str, ...] = ("audio",)
    video: tuple[str, ...] = ("video",)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every key a row may need, once each."""
        return tuple(dict.fromkeys((self.id, *self.image, self.text, *self.audio, *self.video, *self.keep)))

    @property
    def media(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(modality, candidate keys) of each medium."""
        return ("image", self.image), ("audio", self.audio), ("video", self.video)


def option_keys(cfg: ManifestConfig, id_key: str, image: tuple[str, ...], text: str,
                audio: tuple[str, ...] = ("audio",), video: tuple[str, ...] = ("video",)) -> Keys:
    """A format's default keys with the options given over them: `--id-key`, `--image-key`,
    `--text-key`, `--audio-key` and `--video-key` each replace one default (a format's
    `Format.keys`; manifests default to `id`, `image`, `text`, `audio`, `video`)."""

    def given(key: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
        return (key,) if key else default

    return Keys(cfg.id_key or id_key, given(cfg.image_key, image), cfg.text_key or text, tuple(cfg.keep),
                given(cfg.audio_key, audio), given(cfg.video_key, video))


def check_columns(names: Sequence[str], path: str, keys: Keys) -> None:
    """A header or schema without the id column, or without any image, text, audio or video
    column, would make every row invalid: a usage error (a wrong --id-key), not millions of error rows."""
    if keys.id not in names:
        raise ManifestError(f'manifest {path} has no "{keys.id}" column '
                            f"(columns: {', '.join(names)})")
    if not set(keys.image + keys.audio + keys.video) & set(names) and keys.text not in names:
        raise ManifestError(f'manifest {path} has neither an "{"/".join(keys.image)}" nor a '
                            f"\"{keys.text}\" column, nor audio or video (columns: {', '.join(names)})")


def to_row(path: str, line: int | None, offset: int, record: dict[str, Any] | None,
           error: MMError | None, keys: Keys, base_dir: str, place: str | None = None) -> ManifestRow | InvalidRow:
    """Validate one record into a ManifestRow, or an InvalidRow saying which key is wrong.
    Relative media paths resolve against `base_dir`. `place` is the record's key where its
    format finds records by key (a folder's sample: its relative path, which does not move when
    files are added or removed; its offset, the place in the walk, does)."""
    row_id = _valid_id(record, keys.id)
    if error is not None:
        return InvalidRow(path, line, offset, error, row_id, place)
    assert record is not None

    def invalid(message: str, reason: str) -> InvalidRow:
        return InvalidRow(path, line, offset, MMError(message, stage="validate", reason=reason), row_id, place)

    raw_id = record.get(keys.id)
    if row_id is None and (raw_id is None or isinstance(raw_id, str)):
        what = "no" if raw_id is None else "an empty"
        return invalid(f'row has {what} "{keys.id}" field', "manifest.missing_id")
    if row_id is None:
        return invalid(f'"{keys.id}" must be a string or an integer, not {kind(raw_id)}', "manifest.invalid_type")
    found = {m: next((k for k in cands if record.get(k) is not None), cands[0]) for m, cands in keys.media}
    bad = next((k for k in (keys.id, *found.values(), keys.text, *keys.keep) if not _utf8(record.get(k))), None)
    if bad is not None:
        return invalid(f'"{bad}" is not valid Unicode (a lone surrogate)', "manifest.invalid_type")
    media: dict[str, str | bytes | None] = {}
    for modality, key in found.items():
        try:
            media[modality] = _media_value(record.get(key))
        except TypeError as exc:
            return invalid(f'"{key}" must be a path, a URL or bytes, not {exc}', "manifest.invalid_type")
    text = record.get(keys.text)
    if text is not None and not isinstance(text, str):
        return invalid(f'"{keys.text}" must be a string, not {kind(text)}', "manifest.invalid_type")
    if text is None and all(v is None for v in media.values()):
        return invalid(f'row has neither "{"/".join(keys.image)}" nor "{keys.text}" (nor audio or video)',
                       "manifest.empty_row")
    return ManifestRow(id=row_id, manifest=path, line=line, offset=offset, image=media["image"], text=text,
                       keep={key: record.get(key) for key in keys.keep},
                       base_dir=base_dir,
                       audio=media["audio"], video=media["video"], key=place)


def _utf8(value: Any) -> bool:
    """False for a str (or a str inside a list/dict) that UTF-8 cannot encode (lone surrogates)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_utf8(k) and _utf8(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_utf8(v) for v in value)
    return True


def _valid_id(record: dict[str, Any] | None, key: str) -> str | None:
    """The row's id as a str when it is a non-blank str or an int (JSON/Parquet ints), else None."""
    value = None if record is None else record.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    value = str(value)
    return value if value.strip() else None


def _media_value(value: Any) -> str | bytes | None:
    """An image, audio or video value as a str or bytes (None when absent or blank); the Hugging Face {bytes, path}
    struct gives its bytes when present, else its path. TypeError names an unusable type."""
    if value is None:
        return None
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value) or None
    if isinstance(value, dict) and value.keys() <= {"bytes", "path"}:
        data, path = value.get("bytes"), value.get("path")
        if isinstance(data, (bytes, bytearray)) and data:
            return bytes(data)
        if (data is None or isinstance(data, (bytes, bytearray))) and (path is None or isinstance(path, str)):
            return path if path and path.strip() else None
    raise TypeError(kind(value))


def kind(value: Any) -> str:
    """A value's type in words, for messages."""
    return _KINDS.get(type(value), type(value).__name__)
