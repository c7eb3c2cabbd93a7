"""An output in an object store (`s3://`, `gs://`, `az://`/`abfs://`, `memory://`), through fsspec.

Nothing is renamed or appended in a bucket. A file is staged in a local temp folder (bounded: a
shard at a time per writer, removed once uploaded) and written as one object, in one PUT or a
multipart upload that completes or leaves nothing visible. `create` writes an object only if its
name is free, with the store's exclusive create (fsspec's `xb` mode: S3 `If-None-Match: *`, GCS
generation 0, Azure no-overwrite), so a name is a commit that two runners cannot both make.
Whether a store really refuses the second create is probed at a task's start (`probe`).

Every call is bounded: `client_options` gives each store's client a connect and a read timeout
and a bounded number of retries (throttling and 5xx answers retried with backoff), so a store that
accepts connections and never answers fails a call within about two minutes; what still fails is
an `OSError`, a fault of the output, naming the endpoint. A stop request ends a wait on the store
within seconds (`stopping.bounded`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

from ..errors import ConfigError, OutputError
from ..stopping import bounded

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
    bounded_options = client_options(scheme, options)  # a bad MMENC_STORE_* is its own ConfigError (exit 2)
    try:
        import fsspec
        from upath import UPath

        fsspec.get_filesystem_class(scheme)
        OPENED.append(scheme)
        # no listing cache: another runner's objects appear between two calls, and a cached
        # listing would hide them (a read of run.json right after losing the race to create it)
        return UPath(url.rstrip("/"), **{"use_listings_cache": False, **bounded_options})
    except (ImportError, ValueError) as exc:
        package = PACKAGES.get(scheme, f"the fsspec backend for {scheme}://")
        raise OutputError(f"--out {url}: no filesystem for {scheme}:// here ({exc}); install {package} "
                          f"(pip install {package})") from None


#: what bounds a store call (each overridden by its environment variable): with s3fs's own five
#: tries of a call, a store that never answers fails it after about 5 x 2 x 12 s, two minutes
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 10.0, 12.0, 2
BOUNDS_ENV = ("MMENC_STORE_CONNECT_TIMEOUT", "MMENC_STORE_READ_TIMEOUT", "MMENC_STORE_ATTEMPTS")
_S3 = ("s3", "s3a")
_AZURE = ("az", "abfs", "abfss")


def bounds() -> tuple[float, float, int]:
    """(connect timeout s, read timeout s, attempts by the client) for store calls: the defaults,
    or the environment's `BOUNDS_ENV` (ConfigError for a value that is not a positive number)."""
    values: list[float] = []
    for name, default in zip(BOUNDS_ENV, (CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS)):
        text = os.environ.get(name, "").strip()
        try:
            value = float(text) if text else float(default)
        except ValueError:
            value = 0.0
        if value <= 0:
            raise ConfigError(f"{name}={text!r} is not a positive number")
        values.append(value)
    return values[0], values[1], max(1, int(values[2]))


def client_options(scheme: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fsspec options of a store's client for `scheme`: a connect and a read timeout and a
    bounded number of attempts where its client takes them (s3fs: botocore's config, in "standard"
    retry mode; adlfs: its two timeouts; gcsfs: none, its own apply), under `options` (the user's
    `--storage-option`s win, key by key inside a dict such as `config_kwargs`)."""
    connect, read, attempts = bounds()
    scheme = scheme.lower()
    ours: dict[str, Any] = {}
    if scheme in _S3:
        ours = {"config_kwargs": {"connect_timeout": connect, "read_timeout": read,
                                  "retries": {"total_max_attempts": attempts, "mode": "standard"}}}
    elif scheme in _AZURE:
        ours = {"connection_timeout": max(1, round(connect)), "read_timeout": max(1, round(read))}
    return _merged(ours, dict(options or {}))


def _merged(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    out = dict(ours)
    for key, value in theirs.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def endpoint(scheme: str, options: dict[str, Any] | None = None, fs: Any = None) -> str:
    """The endpoint a store's calls go to, for messages: the options' `endpoint_url` (or the
    client's), else `AWS_ENDPOINT_URL` for S3, else the store's own."""
    opts = options or {}
    given = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
    given = given or getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
    if scheme.lower() in _S3:
        given = given or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return str(given or f"the {scheme}:// store's own endpoint")


def client_message(exc: BaseException, where: str | None = None) -> str:
    """One line for a store client's error: its own reason; for a store that could not be reached
    or did not answer, `where` (the endpoint) named first."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    name = type(exc).__name__
    if where and any(word in name for word in ("Timeout", "EndpointConnection", "Connect", "Connection")):
        return f"the store at {where} did not answer ({name}: {text})"
    return text if isinstance(exc, OSError) else f"{name}: {text}"


_CLIENT_MODULES = ("botocore", "aiobotocore", "s3fs", "gcsfs", "adlfs", "azure", "google", "aiohttp", "fsspec",
                   "upath")


def store_fault(exc: BaseException) -> OutputError | None:
    """A store client's error (or an OSError raised inside a store client) as the output fault it
    is (exit 3, the store's own reason in one line); None for anything else."""
    if isinstance(exc, OutputError):
        return None
    module = type(exc).__module__.split(".", 1)[0]
    tb, inside = exc.__traceback__, module in _CLIENT_MODULES
    while tb is not None and not inside:
        inside = tb.tb_frame.f_globals.get("__name__", "").split(".", 1)[0] in _CLIENT_MODULES
        tb = tb.tb_next
    if not inside:
        return None
    where = endpoint("s3") if "boto" in module or "s3" in module else None
    return OutputError(f"object store: {client_message(exc, where)}")


def _drop_expect(params: dict[str, Any], **_: Any) -> None:
    params.get("headers", {}).pop("Expect", None)


def _without_expect(fs: Any) -> None:
    """Writes to S3 without `Expect: 100-continue` (botocore adds it to every PUT): aiohttp waits
    for the interim answer with no timeout, so a store that never answers would hold a write for
    ever whatever the read timeout; the body is sent at once instead."""
    protocol = getattr(fs, "protocol", ())
    if "s3" not in (protocol if isinstance(protocol, (tuple, list)) else (protocol,)) or not hasattr(fs, "connect"):
        return
    fs.connect()  # the client, made now (no request): its handlers, and its session's for later clients
    for events in (fs.s3.meta.events, fs.session):
        events.register("before-call.s3", _drop_expect, unique_id="mmenc-no-expect")


@contextlib.contextmanager
def client_errors(where: str | None = None) -> Iterator[None]:
    """The store client's own errors (botocore's missing credentials, an endpoint that cannot be
    reached: not OSErrors) as the OSError of an output fault, naming `where` (the endpoint) when
    the store did not answer."""
    try:
        yield
    except Exception as exc:  # the client's exception classes vary by store (botocore's timeouts are OSErrors)
        if isinstance(exc, OSError) and type(exc).__module__.split(".", 1)[0] not in _CLIENT_MODULES:
            raise
        raise OSError(client_message(exc, where)) from exc


class StoreFS:
    """An object store behind fsspec: publish and create objects from local staging. Every call
    into the store raises OSError on a failure (`client_errors`)."""

    appends = False
    url = True

    def __init__(self, fs: Any, where: str | None = None) -> None:
        self.fs = fs
        protocol = getattr(fs, "protocol", "")
        self.where = where or endpoint(protocol if isinstance(protocol, str) else protocol[0], None, fs)
        self.staging = Path(tempfile.mkdtemp(prefix="mmenc-stage-"))
        _without_expect(fs)

    def _call(self, fn: Any, what: str) -> Any:
        """`fn()`, a call into the store: its errors as OSErrors, its wait bounded by a stop request."""
        with client_errors(self.where):
            return bounded(fn, what)

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
            self._call(lambda: self.fs.put_file(str(local), self._key(path)), f"writing {self._key(path)}")
        finally:
            local.unlink(missing_ok=True)
        return path

    def create(self, path: Any, content: Any) -> bool:
        """Write the object at `path` only if the name is free; True when this call created it."""
        local = self.stage(path, content)
        try:
            self._call(lambda: self._create(local, self._key(path)), f"creating {self._key(path)}")
            return True
        except FileExistsError:
            return False
        finally:
            local.unlink(missing_ok=True)

    def _create(self, local: Path, key: str) -> None:
        with open(local, "rb") as src, self.fs.open(key, "xb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)

    def append(self, path: Any, data: bytes, sync: bool = True) -> None:
        raise OSError(f"{path}: an object store appends nothing")  # callers write parts instead

    def listdir(self, folder: Any) -> list[tuple[str, int, bool]]:
        """(name, size, is_dir) of each object or prefix right under `folder`."""
        try:
            key = self._key(folder)
            entries = self._call(lambda: self.fs.ls(key, detail=True, refresh=True), f"listing {key}")
        except FileNotFoundError:
            return []
        return [(e["name"].rstrip("/").rsplit("/", 1)[-1], int(e.get("size") or 0), e.get("type") == "directory")
                for e in entries]

    def size(self, path: Any) -> int:
        """An object's size in bytes."""
        return int(self._call(lambda: self.fs.size(self._key(path)), f"reading the size of {self._key(path)}"))

    def remove(self, path: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(lambda: self.fs.rm_file(self._key(path)), f"removing {self._key(path)}")

    def remove_tree(self, folder: Any) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(lambda: self.fs.rm(self._key(folder), recursive=True), f"removing {self._key(folder)}")

    def read_many(self, paths: list[Any], batch: int = 256) -> Iterator[bytes | None]:
        """Each object's bytes (None when missing), in order: fetched `batch` at a time, concurrently
        (one GET each; a resume over thousands of key files waits for few round trips)."""
        for start in range(0, len(paths), batch):
            keys = [self._key(p) for p in paths[start:start + batch]]
            got = self._call(lambda: self.fs.cat(keys, on_error="omit", **self._one_get), f"reading {keys[0]}, ...") \
                if keys else {}
            for key in keys:
                yield got.get(key)

    def reader(self, path: Any) -> Any:
        """What pyarrow reads an object through: a seekable file (ranges fetched as needed)."""
        return self._call(lambda: self.fs.open(self._key(path), "rb"), f"opening {self._key(path)}")

    @contextlib.contextmanager
    def local_copy(self, path: Any) -> Iterator[Path]:
        """The object downloaded to a local temp file (what safetensors opens), removed after."""
        local = self.staging / f"{uuid.uuid4().hex}-{Path(self._key(path)).name}"
        self._call(lambda: self.fs.get_file(self._key(path), str(local)), f"reading {self._key(path)}")
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
            uploads = self._call(lambda: self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=start),
                                 f"listing the uploads under {bucket}/{start}").get("Uploads", [])
            for up in uploads:
                self._call(lambda: self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"],
                                                   UploadId=up["UploadId"]), f"aborting an upload of {up['Key']}")
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


__all__ = ["StoreFS", "bounds", "client_options", "endpoint", "is_store", "local_root", "open_root", "store_fault"]
