"""Validation: one raw record -> a `ManifestRow`, or an `InvalidRow` saying which key is wrong."""

from __future__ import annotations

import os
from typing import Any, Sequence

from ..config import ManifestConfig
from ..errors import ManifestError, MMError
from ..records import InvalidRow, ManifestRow

_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          list: "an array", dict: "an object", bytes: "bytes", type(None): "null"}


def check_columns(names: Sequence[str], path: str, cfg: ManifestConfig) -> None:
    """A header or schema without the id column, or without both the image and the text column,
    would make every row invalid: a usage error (a wrong --id-key), not millions of error rows."""
    if cfg.id_key not in names:
        raise ManifestError(f'manifest {path} has no "{cfg.id_key}" column '
                            f"(columns: {', '.join(names)})")
    if cfg.image_key not in names and cfg.text_key not in names:
        raise ManifestError(f'manifest {path} has neither an "{cfg.image_key}" nor a '
                            f"\"{cfg.text_key}\" column (columns: {', '.join(names)})")


def to_row(path: str, line: int | None, offset: int, record: dict[str, Any] | None,
           error: MMError | None, cfg: ManifestConfig) -> ManifestRow | InvalidRow:
    """Validate one record into a ManifestRow, or an InvalidRow saying which key is wrong."""
    row_id = _valid_id(record, cfg.id_key)
    if error is not None:
        return InvalidRow(path, line, offset, error, row_id)
    assert record is not None

    def invalid(message: str, reason: str) -> InvalidRow:
        return InvalidRow(path, line, offset, MMError(message, stage="validate", reason=reason), row_id)

    raw_id = record.get(cfg.id_key)
    if row_id is None and (raw_id is None or isinstance(raw_id, str)):
        what = "no" if raw_id is None else "an empty"
        return invalid(f'row has {what} "{cfg.id_key}" field', "manifest.missing_id")
    if row_id is None:
        return invalid(f'"{cfg.id_key}" must be a string or an integer, not {kind(raw_id)}',
                       "manifest.invalid_type")
    bad = next((k for k in (cfg.id_key, cfg.image_key, cfg.text_key, *cfg.keep) if not _utf8(record.get(k))), None)
    if bad is not None:
        return invalid(f'"{bad}" is not valid Unicode (a lone surrogate)', "manifest.invalid_type")
    try:
        image = _image_value(record.get(cfg.image_key))
    except TypeError as exc:
        return invalid(f'"{cfg.image_key}" must be a path, a URL or bytes, not {exc}',
                       "manifest.invalid_type")
    text = record.get(cfg.text_key)
    if text is not None and not isinstance(text, str):
        return invalid(f'"{cfg.text_key}" must be a string, not {kind(text)}', "manifest.invalid_type")
    if image is None and text is None:
        return invalid(f'row has neither "{cfg.image_key}" nor "{cfg.text_key}"', "manifest.empty_row")
    return ManifestRow(id=row_id, manifest=path, line=line, offset=offset, image=image, text=text,
                       keep={key: record.get(key) for key in cfg.keep},
                       base_dir=os.path.dirname(path))


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


def _image_value(value: Any) -> str | bytes | None:
    """The image as a str or bytes (None when absent or blank); the Hugging Face {bytes, path}
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
