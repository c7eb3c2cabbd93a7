"""The filesystem an output lives on. `LocalFS` is a POSIX folder: a file is published by writing a
temp file beside its final name, fsyncing it, renaming it into place and fsyncing the folder, so a
reader sees the old file or the new one, never part of one, and a crash leaves no torn file.

An output's code reaches the disk only through these few operations, so another backend (an
object store, where nothing is renamed or appended) can stand in for this one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from ..errors import OutputError

#: what publishes a file's content: bytes, or a function that writes the file at a path it is given
Content = bytes | Callable[[Path], None]


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename in it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalFS:
    """A local (POSIX) filesystem: atomic publish by temp file, fsync and rename."""

    def stage(self, tmp: Path, content: Content) -> Path:
        """Write `content` to the temp path `tmp` and fsync it (removed again on failure)."""
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            if isinstance(content, bytes):
                with open(tmp, "wb") as fh:
                    fh.write(content)
            else:
                content(tmp)
            _fsync_file(tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def publish(self, path: Path, content: Content, tmp: Path | None = None) -> Path:
        """Make `path` hold `content`, whole or not at all: staged under `tmp` (default: a hidden
        name beside it), then renamed into place, the folder fsynced. OSError on a fault."""
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = self.stage(tmp or path.with_name(f".{path.name}.{os.getpid()}.tmp"), content)
        try:
            os.replace(staged, path)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
        return path

    def create(self, path: Path, content: Content) -> bool:
        """Publish `path` only if it does not exist yet (concurrent creators race safely: one wins);
        True when this call created it."""
        staged = self.stage(path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"), content)
        try:
            os.link(staged, path)  # fails when another process created it first
            return True
        except FileExistsError:
            return False
        finally:
            staged.unlink(missing_ok=True)
            fsync_dir(path.parent)

    def append(self, path: Path, data: bytes, sync: bool = True) -> None:
        """Append bytes to a file (creating it), flushed, and fsynced with `sync`."""
        with open(path, "ab") as fh:
            fh.write(data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())


LOCAL = LocalFS()


def publish_json(path: Path, data: Any, fs: LocalFS = LOCAL) -> None:
    """Publish a JSON document (indented, sorted keys)."""
    fs.publish(path, (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8"))


def read_json(path: Path) -> Any | None:
    """Read a JSON file; None when absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def metadata_fault(path: Path, exc: OSError) -> OutputError:
    """The run-level error of metadata the output could not take (disk full, read-only, ...)."""
    return OutputError(f"cannot write {path}: {exc.strerror or exc}; free the space or fix the permissions, "
                       "then run the same command")
