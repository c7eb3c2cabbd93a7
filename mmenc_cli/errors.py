"""Failures as data, and the run-level errors that stop a run.

Item-level: every failure of one item (a manifest row, or one modality of a row) is wrapped in one
`MMError` carrying the original message, an HTTP-style code, the pipeline stage and a stable
`reason` slug. Codes keep the client/server split honest:

=====  ==========================================================================================
code   meaning
=====  ==========================================================================================
400    invalid row, undecodable or empty media, bad base64, a directory where a file should be
403    permission denied (local file or remote)
404    missing file, remote 404
409    id already used in this output
413    too large: pixel limit, decompression bomb, file-size limit
415    media type or URL scheme we do not support (HEIC without a plugin, ``ftp://``)
422    valid input the model cannot take (text empty after stripping, a clip without the stream asked for)
500    our failure: encoder error, non-finite output, wrong output count, token-count mismatch,
       a decoder our install should have but lacks
503    remote unavailable after retries (refused, DNS, remote 429/5xx)
504    timed out
507    out of memory for a single item
=====  ==========================================================================================

`REASONS` lists every reason slug with its code; `classify()` is the one place that maps an
arbitrary exception to an `MMError`. An `OSError` means the same wherever it is met (a local file,
an object store, PyAV, an HTTP fetch, `classify`): `OS_REASONS` is the one errno -> reason table
and `os_reason()` the one lookup, so ENOENT is always 404 `media.not_found`, EACCES/EPERM 403, a
timeout 504. The error report that holds them is `report.py`.

Run-level: what stops a run as a whole derives from `RunError`, which carries the process exit
code the CLI ends with (`ExitCode`)::

    RunError                        1  (base; an unexpected run-level failure)
      ConfigError(ValueError)       2  options that cannot work together
      OutputError                   3  output folder not writable, options that conflict with it
      ModelLoadError                3  the model cannot be loaded or used as asked
      ManifestError(ValueError)     3  a manifest that cannot be read at all
      SubmitError                   3  sbatch missing or refusing the script
      LockBusy                     75  another live run holds this task's lock
    LockWaitInterrupted                (internal: a stop signal while waiting for a lock)
"""

from __future__ import annotations

import enum
import errno
import re
import sys

STAGES = ("read", "validate", "load", "decode", "preprocess", "encode", "write")

#: reason slug -> (code, what it means). The README's table is generated from this.
REASONS: dict[str, tuple[int, str]] = {
    "manifest.invalid_json": (400, "the manifest line is not a JSON object"),
    "manifest.invalid_row": (400, "the row cannot be read (bad CSV/Parquet record)"),
    "manifest.missing_id": (400, "the row has no id"),
    "manifest.invalid_type": (400, "a field has the wrong type (id not str/int, text not str, ...)"),
    "manifest.empty_row": (400, "the row has none of image, text, audio, video"),
    "manifest.duplicate_id": (409, "the id was already used in this output"),
    "manifest.row_too_large": (413, "the manifest line or CSV record exceeds --max-row-bytes"),
    "manifest.missing_shard": (404, "a shard or data file that an input names or lists does not exist"),
    "manifest.bad_shard": (400, "an input file or part of one (tar member, Arrow batch, Parquet row group) is "
                                "empty, damaged or unreadable"),
    "media.not_found": (404, "the media file does not exist"),
    "media.permission_denied": (403, "the media file or URL is not readable for us"),
    "media.is_directory": (400, "a directory where a media file should be"),
    "media.empty": (400, "the media file or payload is empty"),
    "media.unreadable": (400, "the bytes are not media we can decode (truncated, corrupt, no samples)"),
    "media.bad_base64": (400, "the data URI's base64 payload is invalid"),
    "media.bad_data_uri": (400, "the data URI is malformed"),
    "media.invalid_source": (400, "the media field is not a path, URL, data URI or bytes"),
    "media.too_large": (413, "the image (or a video frame) exceeds --max-image-pixels, or a decompression bomb"),
    "media.file_too_large": (413, "the file exceeds --max-file-bytes (--max-audio-bytes, --max-video-bytes)"),
    "media.unsupported_format": (415, "a format or codec our install does not decode (e.g. HEIC)"),
    "media.unsupported_scheme": (415, "a URL scheme we do not fetch (e.g. ftp://)"),
    "media.no_stream": (422, "an audio or video file without the stream asked for (a clip with no audio)"),
    "media.decoder_missing": (500, "a decoder our install should have is missing"),
    "remote.not_found": (404, "the remote server answered 404/410"),
    "remote.forbidden": (403, "the remote server answered 401/403"),
    "remote.client_error": (400, "the remote server answered another 4xx"),
    "remote.unavailable": (503, "refused, DNS failure, 429 or 5xx after all retries"),
    "remote.timeout": (504, "the fetch timed out after all retries"),
    "media.timeout": (504, "loading and decoding the item passed its deadline (its worker was replaced)"),
    "text.empty": (422, "the text is empty after stripping"),
    "preprocess.failed": (500, "the model's processor or tokenizer failed on this item"),
    "preprocess.unsupported_shape": (422, "the image's shape is one the model's processor refuses (aspect ratio > 200)"),
    "encode.failed": (500, "the encoder raised on this item (after bisecting its batch)"),
    "encode.non_finite": (500, "the embedding holds NaN or Inf"),
    "encode.output_count": (500, "the encoder returned a different number of outputs than inputs"),
    "encode.token_mismatch": (500, "the encoder produced a different number of tokens than promised"),
    "encode.out_of_memory": (507, "out of memory with this item alone in its batch"),
    "write.failed": (500, "the shard holding this item could not be written"),
    "internal": (500, "an unexpected error in mmenc"),
}


class MMError(Exception):
    """One item's failure: message, HTTP-style `code`, pipeline `stage`, stable `reason` slug.

    `error` keeps the original exception's type name so reports say what really happened.
    """

    def __init__(
        self,
        message: str,
        code: int | None = None,
        stage: str = "encode",
        reason: str = "internal",
        error: str | None = None,
    ) -> None:
        super().__init__(message)
        if reason not in REASONS:
            raise ValueError(f"unknown MMError reason {reason!r}")
        if stage not in STAGES:
            raise ValueError(f"unknown MMError stage {stage!r}")
        self.message = message
        self.code = int(code if code is not None else REASONS[reason][0])
        self.stage = stage
        self.reason = reason
        self.error = error or "MMError"

    def __reduce__(self):  # picklable across worker processes
        return (MMError, (self.message, self.code, self.stage, self.reason, self.error))

    def __repr__(self) -> str:
        return f"MMError({self.code} {self.reason} at {self.stage}: {self.message})"


_SURROGATES = re.compile("[\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` with lone surrogates (not valid Unicode: from a manifest's JSON escapes, or a file
    name's undecodable bytes) written as `\\udXXX`, so it can be printed and encoded as UTF-8."""
    return _SURROGATES.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def trim_message(message: str, limit: int = 500) -> str:
    """Keep a message readable in a report: one line, at most `limit` characters."""
    message = " ".join(str(message).split())
    return message if len(message) <= limit else message[: limit - 1] + "…"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


#: errno -> reason: what an OSError says of the file, object or URL being read. The one table:
#: `os_reason` reads it for local files, object stores, PyAV, HTTP and `classify`.
OS_REASONS: dict[int, str] = {
    errno.ENOENT: "media.not_found",
    errno.ENOTDIR: "media.not_found",  # a component of the path is a file
    errno.EACCES: "media.permission_denied",
    errno.EPERM: "media.permission_denied",
    errno.EISDIR: "media.is_directory",
    errno.ENAMETOOLONG: "media.invalid_source",
    errno.ELOOP: "media.invalid_source",
    errno.ETIMEDOUT: "remote.timeout",
    errno.ENOSPC: "write.failed",
}

#: the errno each OSError subclass stands for: fsspec raises FileNotFoundError(path) and a socket
#: times out with TimeoutError("timed out"), both without an errno
_OS_CLASSES: tuple[tuple[type[OSError], int], ...] = (
    (FileNotFoundError, errno.ENOENT), (PermissionError, errno.EACCES), (IsADirectoryError, errno.EISDIR),
    (NotADirectoryError, errno.ENOTDIR), (TimeoutError, errno.ETIMEDOUT))

#: reasons that speak of a path: a socket's EACCES/EPERM is a local firewall or a full conntrack
#: table (often passing), not a URL we may not read
_PATH_REASONS = frozenset({"media.not_found", "media.permission_denied", "media.is_directory", "media.invalid_source"})


def os_reason(exc: BaseException, connection: bool = False) -> str | None:
    """The reason slug (`OS_REASONS`) of an OSError; None for one the table says nothing of, and
    for anything else. `connection`: raised by a network connection, where only the reasons that
    do not speak of a path apply (a timeout)."""
    if not isinstance(exc, OSError) or _is_ssl_error(exc):
        return None
    number = next((n for cls, n in _OS_CLASSES if isinstance(exc, cls)), exc.errno)
    reason = OS_REASONS.get(number or 0)
    return None if connection and reason in _PATH_REASONS else reason


def _is_ssl_error(exc: OSError) -> bool:
    """True for ssl.SSLError, whose errno is OpenSSL's (1 is SSL_ERROR_SSL, not EPERM). Without
    importing ssl: when it is not imported, nothing raised one."""
    ssl = sys.modules.get("ssl")
    return ssl is not None and isinstance(exc, ssl.SSLError)


def classify(exc: BaseException, stage: str) -> MMError:
    """Map any exception raised while handling one item to an `MMError` (the one place that does)."""
    if isinstance(exc, MMError):
        return exc
    name = type(exc).__name__
    msg = trim_message(str(exc) or name)
    reason = os_reason(exc)
    if reason is None and (isinstance(exc, MemoryError) or is_out_of_memory(exc)):
        reason = "encode.out_of_memory"
    if reason is None:
        reason = {"preprocess": "preprocess.failed", "encode": "encode.failed",
                  "write": "write.failed"}.get(stage, "internal")
    return MMError(msg, stage=stage, reason=reason, error=name)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an accelerator's out-of-memory error, without importing torch: by type
    (`torch.OutOfMemoryError`, which `torch.cuda.OutOfMemoryError` names too, and its subclasses,
    however a library renames them), by the message torch and its libraries give when an
    allocation fails, and through its explicit causes (`raise ... from oom`: a compiler or a library
    that wraps it; not an error merely raised while one was handled)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _oom_by_type(e) or (isinstance(e, RuntimeError) and any(s in str(e).lower() for s in OOM_MESSAGES)):
            return True
        e = e.__cause__
    return False


#: what torch, cuBLAS and cuDNN say when a device allocation fails (lower case)
OOM_MESSAGES = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def _oom_by_type(exc: BaseException) -> bool:
    """`exc` is torch's out-of-memory error or a subclass (by the class's name when torch is not
    imported: nothing in this process could have raised torch's then)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if isinstance(oom, type) and isinstance(exc, oom):
        return True
    return any(cls.__name__ in ("OutOfMemoryError", "OutOfMemory") for cls in type(exc).__mro__)


#: CUDA errors after which the device's context is unusable: every later call fails the same way
STICKY_DEVICE_ERRORS = ("illegal memory access", "device-side assert", "misaligned address",
                        "illegal instruction", "unspecified launch failure", "uncorrectable ecc error",
                        "hardware stack error", "launch timed out")


def is_device_fault(exc: BaseException) -> bool:
    """True for a sticky CUDA error (`STICKY_DEVICE_ERRORS`): no later batch can succeed, so it
    ends the run instead of failing items. Without importing torch."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("cuda" in text or type(exc).__name__ == "AcceleratorError") \
        and any(s in text for s in STICKY_DEVICE_ERRORS)


class ExitCode(enum.IntEnum):
    """The exit codes of `mmenc` (README: "Unattended runs")."""

    OK = 0
    INTERNAL = 1
    USAGE = 2
    SETUP = 3
    THRESHOLD = 4
    LOCKED = 75  # EX_TEMPFAIL


class RunError(Exception):
    """A failure of the run as a whole (never of one item); `exit_code` is how the CLI exits."""

    exit_code: int = ExitCode.INTERNAL

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = int(exit_code)

    def __reduce__(self):  # picklable across device worker processes, exit code included
        return (_rebuild_run_error, (type(self), str(self), self.exit_code))


def _rebuild_run_error(cls: type[RunError], message: str, exit_code: int) -> RunError:
    err = cls.__new__(cls)
    RunError.__init__(err, message, exit_code)
    return err


class ConfigError(RunError, ValueError):
    """Options that cannot work together (a usage error)."""

    exit_code = ExitCode.USAGE


class OutputError(RunError):
    """The output folder cannot be used (not writable, conflicting options)."""

    exit_code = ExitCode.SETUP


class DeviceError(RunError):
    """The accelerator failed as a whole (a sticky CUDA error): the run stops, what is committed
    stays, the rest is left for a re-run (exit 1)."""

    exit_code = ExitCode.INTERNAL

    @classmethod
    def of(cls, exc: BaseException, doing: str = "") -> "DeviceError":
        """The run-level error for `exc`, a CUDA error met while `doing` something."""
        return cls(f"the device failed{doing} ({type(exc).__name__}: {first_line(exc)}); its state is lost, so the "
                   "run stops: what is committed stays and a re-run goes on (set CUDA_LAUNCH_BLOCKING=1 to find "
                   "the failing kernel)")


class ModelLoadError(RunError):
    """The model cannot be loaded or used as asked (a startup error, one clear line)."""

    exit_code = ExitCode.SETUP


class ManifestError(RunError, ValueError):
    """A manifest that cannot be read at all: a run-level error, never one row's failure."""

    exit_code = ExitCode.SETUP


class SubmitError(RunError):
    """sbatch is missing or refused the script."""

    exit_code = ExitCode.SETUP


class LockBusy(RunError):
    """Another live process holds this task's lock on OUT."""

    exit_code = ExitCode.LOCKED


class LockWaitInterrupted(Exception):
    """A stop signal arrived while waiting for a task lock (--wait-lock); the run ends interrupted."""


def client_reason(exc: BaseException) -> str:
    """What an object-store client's own error means (one that is not an `OSError`: botocore's and
    the like): missing or refused credentials are the store refusing us (403); anything else, an
    endpoint that cannot be reached or a client fault, is the store unavailable for now (503)."""
    name = type(exc).__name__
    return "media.permission_denied" if "Credential" in name or "Signature" in name else "remote.unavailable"
