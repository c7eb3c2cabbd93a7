"""Where inputs live: local paths, or fsspec URLs (`s3://`, `gs://`, `hf://`, `memory://`, ...)
read as streams through the matching fsspec backend; and the globs and brace ranges
(`shards/{00000..00999}.tar`, `photos/*.parquet`) that mmenc expands itself, so a quoted pattern
works the same in a shell, a cron line and a Slurm script.

A missing fsspec backend is a clear `ManifestError` naming the package to install.
"""

from __future__ import annotations

import glob
import io
import os
import re
from dataclasses import dataclass
from typing import IO, Any

from ..errors import ConfigError, ManifestError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_GLOB = re.compile(r"[*?\[]")


def is_url(path: str) -> bool:
    """A URL other than file:// (which is a local path)."""
    m = _URL.match(path)
    return m is not None and m.group(1).lower() != "file"


def is_pattern(given: str) -> bool:
    """Whether an input is a glob or a brace range that mmenc expands."""
    rest = given.split("://", 1)[-1]
    return bool(_GLOB.search(rest) or _BRACE.search(rest))


def local(path: str) -> str:
    """A local path as an absolute path (file:// URLs unwrapped); URLs unchanged."""
    if path.lower().startswith("file://"):
        path = path[len("file://"):]
    return path if is_url(path) else os.path.abspath(os.path.expanduser(path))


def _fs(url: str) -> tuple[Any, str]:
    """The fsspec filesystem and the path inside it for a URL."""
    try:
        import fsspec.core
    except ImportError:  # pragma: no cover - fsspec comes with huggingface_hub
        raise ManifestError(f"{url}: reading URLs needs the fsspec package (pip install fsspec)") from None
    try:
        from ..output.objectstore import client_options

        # bounded timeouts and retries: an input in a store that never answers fails, never hangs
        return fsspec.core.url_to_fs(url, **client_options(url.split("://", 1)[0]))
    except (ImportError, ValueError) as exc:  # no backend for the protocol, or it is not installed
        raise _no_backend(url, exc) from None


def _no_backend(url: str, exc: Exception) -> ManifestError:
    scheme = url.split("://", 1)[0]
    return ManifestError(f"{url}: no fsspec backend for {scheme}:// here ({exc}); install the package that "
                         f"provides it (s3fs for s3://, gcsfs for gs://, adlfs for az://, ...)")


def check_input(given: str) -> None:
    """What can be told before anything runs: a path given as it is must exist (a usage error),
    a URL's fsspec backend must be installed (a setup error naming the package)."""
    if is_url(given):
        import fsspec

        try:
            fsspec.get_filesystem_class(given.split("://", 1)[0])
        except (ImportError, ValueError) as exc:
            raise _no_backend(given, exc) from None
    elif not is_pattern(given) and not os.path.exists(local(given)):
        raise ConfigError(f"manifest {given} does not exist")


def open_binary(path: str) -> IO[bytes]:
    """A binary, seekable handle on a local file or a URL. A store's file is wrapped in a buffered
    reader: fsspec's buffered files take no size in `readline`, which the line readers bound
    lines with (`lines.read_line`)."""
    if not is_url(path):
        return open(path, "rb")
    fs, inner = _fs(path)
    return io.BufferedReader(fs.open(inner, "rb"), buffer_size=1 << 20)


@dataclass(frozen=True, slots=True)
class Info:
    """What a path is: its size in bytes, whether it is a folder, whether it exists."""

    exists: bool
    is_dir: bool = False
    size: int = 0


def info(path: str) -> Info:
    """Stat a local path or a URL (a folder reached through a URL exists when it lists entries)."""
    if not is_url(path):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return Info(False)
        except OSError as exc:
            raise ManifestError(f"cannot read {path}: {exc}") from None
        return Info(True, os.path.isdir(path), st.st_size)
    fs, inner = _fs(path)
    try:
        entry = fs.info(inner)
    except FileNotFoundError:
        return Info(False)
    return Info(True, entry.get("type") == "directory", int(entry.get("size") or 0))


def listdir(path: str) -> list[tuple[str, bool]]:
    """(name, is_dir) of a folder's entries, sorted by name; symlinks followed."""
    if not is_url(path):
        with os.scandir(path) as it:
            return sorted((e.name, e.is_dir()) for e in it)
    fs, inner = _fs(path)
    return sorted((entry["name"].rstrip("/").rsplit("/", 1)[-1], entry.get("type") == "directory")
                  for entry in fs.ls(inner, detail=True))


def join(base: str, *names: str) -> str:
    """`base` and `names` joined with the separator the path or URL uses."""
    if is_url(base):
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(base, *names)


def real(path: str) -> str:
    """The resolved path of a local folder (to follow a symlink only once); URLs unchanged."""
    return path if is_url(path) else os.path.realpath(path)


def expand_braces(pattern: str) -> list[str]:
    """`a{1..3}b` -> a1b a2b a3b (zero padding kept: `{00..10}`), `a{x,y}` -> ax ay; nested and
    several groups expand left to right."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[:m.start()], m.group(1), pattern[m.end():]
    rng = _RANGE.match(body)
    if rng:
        a, b = int(rng.group(1)), int(rng.group(2))
        width = len(rng.group(1)) if rng.group(1).lstrip("-").startswith("0") else 0
        step = 1 if b >= a else -1
        parts = [f"{n:0{width}d}" for n in range(a, b + step, step)]
    elif "," in body:
        parts = body.split(",")
    else:
        return [head + "{" + body + "}" + t for t in expand_braces(tail)]
    return [e for part in parts for e in expand_braces(head + part + tail)]


def expand(given: str) -> list[tuple[str, bool]]:
    """One input as given on the command line -> (path, from_pattern) in order. A plain path is
    returned as it is (checked later: missing is a usage error); a brace range keeps every name
    (a missing shard becomes an error row); a glob keeps what exists, sorted."""
    names = expand_braces(given)
    braced = len(names) > 1 or names[0] != given
    out: list[tuple[str, bool]] = []
    for name in names:
        path = local(name)
        if not _GLOB.search(name.split("://", 1)[-1]):
            out.append((path, braced))
            continue
        if is_url(path):
            fs, inner = _fs(path)
            scheme = path.split("://", 1)[0]  # kept as given (fsspec would name local:// files file://)
            matches = sorted(f"{scheme}://{m}" for m in fs.glob(inner))
        else:
            matches = sorted(glob.glob(path, recursive=True))
        if not matches:
            raise ManifestError(f"{given}: the pattern {name} matches nothing")
        out += [(m, True) for m in matches]
    return out
