"""An output in an object store (`s3://`, `gs://`, `az://`/`abfs://`, `memory://`), through fsspec.

Nothing is renamed or appended in a bucket. A file is staged in a local temp folder (bounded: a
shard at a time per writer, removed once uploaded) and written as one object, in one PUT or a
multipart upload that completes or leaves nothing visible. `create` writes an object only if its
name is free, with the store's exclusive create (fsspec's `xb` mode: S3 `If-None-Match: *`, GCS
generation 0, Azure no-overwrite), so a name is a commit that two runners cannot both make.
Whether a store really refuses the second create is probed at a task's start (`probe`).

Retries of throttling and 5xx answers are the store client's own (botocore retries S3's 503
SlowDown with backoff); what still fails is an `OSError`, a fault of the output.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

from ..errors import OutputError

#: the fsspec package each store needs, for the message when it is missing
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "memory": "fsspec"}
_UNSUPPORTED = ("http", "https", "ftp", "sftp", "github", "zip", "tar")


#: set once this process opened an output in a store (the CLI then ends without interpreter shutdown)
OPENED: list[str] = []


def open_root(url: str, options: dict[str, str] | None = None) -> Any:
    """The output's root in a store, as a `upath.UPath`. OutputError (exit 3) naming the package
    when the store's filesystem is not installed, or the scheme cannot hold an output."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in _UNSUPPORTED:
        raise OutputError(f"--out {url}: {scheme}:// cannot hold an output (use a folder, or s3://, gs://, az://)")
    try:
        import fsspec
        from upath import UPath

        fsspec.get_filesystem_class(scheme)
        OPENED.append(scheme)
        # no listing cache: another runner's objects appear between two calls, and a cached
        # listing would hide them (a read of run.json right after losing the race to create it)
        return UPath(url.rstrip("/"), **{"use_listings_cache": False, **(options or {})})
    except (ImportError, ValueError) as exc:
        package = PACKAGES.get(scheme, f"the fsspec backend for {scheme}://")
        raise OutputError(f"--out {url}: no filesystem for {scheme}:// here ({exc}); install {package} "
                          f"(pip install {package})") from None


@contextlib.contextmanager
def client_errors() -> Iterator[None]:
    """The store client's own errors (botocore's missing credentials, an endpoint that cannot be
    reached: not OSErrors) as the OSError of an output fault."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:  # the client's exception classes vary by store
        raise OSError(f"{type(exc).__name__}: {exc}") from exc


class StoreFS:
    """An object store behind fsspec: publish and create objects from local staging. Every call
    into the store raises OSError on a failure (`client_errors`)."""

    appends = False
    url = True

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.staging = Path(tempfile.mkdtemp(prefix="mmenc-stage-"))

    @property
    def _one_get(self) -> dict[str, int]:
        """The option that makes s3fs read a small object with one GET (not a HEAD first, to split
        a large one into concurrent ranges); other stores take none."""
        import inspect

        cat_file = getattr(self.fs, "_cat_file", None)
        takes = cat_file is not None and "max_concurrency" in inspect.signature(cat_file).parameters
        return {"max_concurrency": 1} if takes else {}

    def _key(self, path: Any) -> str:
        return path.path if hasattr(path, "path") else str(path)

    def stage(self, tmp: Any, content: Any) -> Path:
        """Write `content` to a local temp file (never in the store); removed on failure."""
        local = self.staging / f"{uuid.uuid4().hex}-{Path(str(tmp)).name}"
        try:
            if isinstance(content, bytes):
                local.write_bytes(content)
            else:
                content(local)
        except BaseException:
            local.unlink(missing_ok=True)
            raise
        return local

    def publish(self, path: Any, content: Any, tmp: Any = None) -> Any:
        """Write the object at `path` (overwriting), whole or not at all."""
        local = self.stage(tmp or path, content)
        try:
            with client_errors():
                self.fs.put_file(str(local), self._key(path))
        finally:
            local.unlink(missing_ok=True)
        return path

    def create(self, path: Any, content: Any) -> bool:
        """Write the object at `path` only if the name is free; True when this call created it."""
        local = self.stage(path, content)
        try:
            with client_errors(), open(local, "rb") as src, self.fs.open(self._key(path), "xb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
            return True
        except FileExistsError:
            return False
        finally:
            local.unlink(missing_ok=True)

    def append(self, path: Any, data: bytes, sync: bool = True) -> None:
        raise OSError(f"{path}: an object store appends nothing")  # callers write parts instead

    def listdir(self, folder: Any) -> list[tuple[str, int, bool]]:
        """(name, size, is_dir) of each object or prefix right under `folder`."""
        try:
            with client_errors():
                entries = self.fs.ls(self._key(folder), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return [(e["name"].rstrip("/").rsplit("/", 1)[-1], int(e.get("size") or 0), e.get("type") == "directory")
                for e in entries]

    def remove(self, path: Any) -> None:
        with contextlib.suppress(FileNotFoundError), client_errors():
            self.fs.rm_file(self._key(path))

    def remove_tree(self, folder: Any) -> None:
        with contextlib.suppress(FileNotFoundError), client_errors():
            self.fs.rm(self._key(folder), recursive=True)

    def read_many(self, paths: list[Any], batch: int = 256) -> Iterator[bytes | None]:
        """Each object's bytes (None when missing), in order: fetched `batch` at a time, concurrently
        (one GET each; a resume over thousands of key files waits for few round trips)."""
        for start in range(0, len(paths), batch):
            keys = [self._key(p) for p in paths[start:start + batch]]
            with client_errors():
                got = self.fs.cat(keys, on_error="omit", **self._one_get) if keys else {}
            for key in keys:
                yield got.get(key)

    def reader(self, path: Any) -> Any:
        """What pyarrow reads an object through: a seekable file (ranges fetched as needed)."""
        return self.fs.open(self._key(path), "rb")

    @contextlib.contextmanager
    def local_copy(self, path: Any) -> Iterator[Path]:
        """The object downloaded to a local temp file (what safetensors opens), removed after."""
        local = self.staging / f"{uuid.uuid4().hex}-{Path(self._key(path)).name}"
        with client_errors():
            self.fs.get_file(self._key(path), str(local))
        try:
            yield local
        finally:
            local.unlink(missing_ok=True)

    def probe(self, folder: Any) -> bool:
        """Whether the store refuses to create an object whose name exists: `probe-<uuid>` created
        twice; the probe is removed again."""
        probe = f"{self._key(folder)}/probe-{uuid.uuid4().hex}"
        first = self.create(probe, b"1")
        second = self.create(probe, b"2") if first else True
        self.remove(probe)
        return first and not second

    def abort_uploads(self, folder: Any, prefix: str) -> int:
        """Abort the multipart uploads a killed run left under `folder` for names starting with
        `prefix` (S3 only; elsewhere nothing is left). The number aborted."""
        if "s3" not in str(getattr(self.fs, "protocol", "")):
            return 0
        bucket, _, key = self._key(folder).partition("/")
        start = f"{key}/{prefix}" if key else prefix
        try:
            uploads = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=start).get("Uploads", [])
            for up in uploads:
                self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        except (OSError, KeyError):  # best effort: a lifecycle rule clears what is left
            return 0
        return len(uploads)

    def close(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def is_store(root: str) -> bool:
    """Whether `--out` names an object store (a URL other than `file://`)."""
    return "://" in root and not root.lower().startswith("file://")


def local_root(root: str) -> str:
    """A local `--out`, with `file://` stripped."""
    return root[7:] if root.lower().startswith("file://") else root


__all__ = ["StoreFS", "is_store", "local_root", "open_root"]
