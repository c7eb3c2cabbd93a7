"""The filesystem an output lives on: a local folder (`LocalFS`) or an object store (`StoreFS`,
`stores.py`). An output's code reaches its storage only through these few operations.

`LocalFS` is a POSIX folder: a file is published by writing a temp file beside its final name,
fsyncing it, renaming it into place and fsyncing the folder, so a reader sees the old file or the
new one, never part of one, and a crash leaves no torn file; `create` (publish unless the name
exists) links the staged file into place, which fails when another process was first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

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

    #: a local folder renames and appends; an object store does neither
    appends = True
    url = False

    def listdir(self, folder: Any) -> list[tuple[str, int, bool]]:
        """(name, size, is_dir) of each entry of `folder` (empty when it does not exist)."""
        try:
            with os.scandir(folder) as it:
                return [(e.name, e.stat().st_size if e.is_file() else 0, e.is_dir()) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, path: Any) -> None:
        Path(path).unlink(missing_ok=True)

    def remove_tree(self, folder: Any) -> None:
        shutil.rmtree(folder, ignore_errors=True)

    def read_many(self, paths: list[Any]) -> Iterator[bytes | None]:
        """Each file's bytes (None when missing or unreadable), in order, read as they are asked for."""
        for path in paths:
            try:
                yield Path(path).read_bytes()
            except OSError:
                yield None

    def reader(self, path: Any) -> Any:
        """What pyarrow and safetensors read a file through: its path."""
        return str(path)

    def local_copy(self, path: Any) -> contextlib.AbstractContextManager[Path]:
        """The file as a local path (it is one already)."""
        return contextlib.nullcontext(Path(path))


LOCAL = LocalFS()


def publish_json(path: Any, data: Any, fs: Any = LOCAL) -> None:
    """Publish a JSON document (indented, sorted keys)."""
    fs.publish(path, (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode("utf-8"))


@contextlib.contextmanager
def parquet_source(path: Any) -> Iterator[Any]:
    """What pyarrow reads a Parquet file through: a local file by its name (pyarrow's own reader;
    one read through a Python file object can make pyarrow abort at interpreter shutdown), an
    object in a store as a file object."""
    if isinstance(path, Path):
        yield str(path)
        return
    with path.open("rb") as fh:
        yield fh


def read_json(path: Any) -> Any | None:
    """Read a JSON file (a local path or a store's); None when absent or unreadable. An object in a
    store is one GET: a file object's HEAD then ranged GET fails (s3fs's FileExpired) when another
    runner rewrites the object in between, as heartbeats and commits rewrite a task's record."""
    try:
        if isinstance(path, Path):
            return json.loads(path.read_bytes())
        return json.loads(path.fs.cat_file(path.path))
    except (FileNotFoundError, ValueError):
        return None


def metadata_fault(path: Path, exc: OSError) -> OutputError:
    """The run-level error of metadata the output could not take (disk full, read-only, ...)."""
    return OutputError(f"cannot write {path}: {exc.strerror or exc}; free the space or fix the permissions, "
                       "then run the same command")
