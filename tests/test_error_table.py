"""One OSError -> reason table (`errors.OS_REASONS`): every place that meets an OSError (classify,
local files, object stores, PyAV, HTTP) gives the same code and reason, and no module outside
errors.py maps errno values or OSError subclasses itself."""

from __future__ import annotations

import ast
import builtins
import errno
import os
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest

from mmenc_cli.config import MediaConfig
from mmenc_cli.errors import OS_REASONS, REASONS, classify, os_reason
from mmenc_cli.media.http import Transient, _network_error
from mmenc_cli.media.sources import file_error
from mmenc_cli.media.stores import StoreFile, store_error

PACKAGE = Path(__file__).resolve().parent.parent / "mmenc_cli"

#: OSError's own subclasses (FileNotFoundError, PermissionError, TimeoutError, ...), and socket.timeout
OS_SUBCLASSES = frozenset({n for n, v in vars(builtins).items()
                           if isinstance(v, type) and issubclass(v, OSError) and v is not OSError} | {"timeout"})

#: (module, errno name) used outside errors.py, and why it maps nothing to a code
ERRNO_ALLOWED = {
    ("output/locks.py", "EAGAIN"): "flock's 'held by another process': whether to wait, not an item's failure",
    ("output/locks.py", "EWOULDBLOCK"): "the same answer under its other name",
    ("output/locks.py", "EACCES"): "the same answer on systems whose flock says EACCES",
}

@pytest.mark.parametrize("number,reason", sorted(OS_REASONS.items()))
def test_every_place_reads_an_errno_the_same(number: int, reason: str) -> None:
    exc = OSError(number, os.strerror(number), "/data/x.png")
    code = REASONS[reason][0]
    found = [classify(exc, "decode"), file_error(exc), store_error(exc, "s3://bucket/x.png")]
    assert [(e.code, e.reason) for e in found if e is not None] == [(code, reason)] * 3
    assert [e.stage for e in found if e is not None] == ["decode", "load", "load"]


@pytest.mark.parametrize("exc,number", [
    (FileNotFoundError("s3://bucket/x.png"), errno.ENOENT),  # fsspec raises it with no errno
    (PermissionError("forbidden"), errno.EACCES),
    (IsADirectoryError("a folder"), errno.EISDIR),
    (NotADirectoryError("a file on the way"), errno.ENOTDIR),
    (TimeoutError("timed out"), errno.ETIMEDOUT),
    (socket.timeout("timed out"), errno.ETIMEDOUT),
])
def test_a_subclass_without_errno_means_its_errno(exc: OSError, number: int) -> None:
    assert os_reason(exc) == OS_REASONS[number]
    assert store_error(exc, "s3://bucket/x.png").reason == OS_REASONS[number]


def test_what_the_table_does_not_know_is_each_place_s_own() -> None:
    exc = OSError(errno.EIO, "Input/output error")
    assert os_reason(exc) is None and file_error(exc) is None
    assert (store_error(exc, "s3://b/x").code, store_error(exc, "s3://b/x").reason) == (503, "remote.unavailable")
    assert classify(exc, "encode").reason == "encode.failed" and classify(exc, "load").reason == "internal"
    assert os_reason(ValueError("not an OSError")) is None


def test_an_ssl_error_s_errno_is_openssl_s_not_the_os() -> None:
    exc = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")  # 1 is also EPERM
    assert os_reason(exc) is None and classify(exc, "load").reason == "internal"
    out = _network_error(exc, "https://example.org/x.png", MediaConfig())
    assert isinstance(out, Transient) and out.error.reason == "remote.unavailable"


@pytest.mark.parametrize("exc,reason", [
    (TimeoutError("timed out"), "remote.timeout"),
    (OSError(errno.ETIMEDOUT, "Connection timed out"), "remote.timeout"),
    (ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), "remote.unavailable"),
    # a socket's EPERM is a local firewall or a full conntrack table: not the URL's 403, and retried
    (PermissionError(errno.EPERM, "Operation not permitted"), "remote.unavailable"),
])
def test_a_connection_reads_only_what_is_not_about_a_path(exc: OSError, reason: str) -> None:
    out = _network_error(exc, "https://example.org/x.png", MediaConfig())
    assert isinstance(out, Transient) and out.error.reason == reason and out.error.stage == "load"
    assert os_reason(PermissionError(errno.EPERM, "x"), connection=True) is None


def test_pyav_reading_a_store_that_times_out_is_504() -> None:
    pytest.importorskip("av")
    from mmenc_cli.media.audio import decode_audio
    from mmenc_cli.errors import MMError

    class Failing:
        def open(self, path: str, mode: str) -> Any:
            raise TimeoutError("read timed out")

    with pytest.raises(MMError) as err:
        decode_audio(StoreFile(Failing(), "x.wav", "s3://b/x.wav"), 16000, None)
    assert (err.value.code, err.value.reason, err.value.stage) == (504, "remote.timeout", "load")


# -- the source: nobody else maps OSErrors

def _names(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [n for e in node.elts for n in _names(e)]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def _builds_an_error(body: list[ast.stmt]) -> bool:
    """True when a handler's body names a reason slug or builds an MMError (directly or through a helper)."""
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Constant) and node.value in REASONS:
            return True
        if isinstance(node, ast.Call) and any(n in ("MMError", "load_error", "decode_error") for n in _names(node.func)):
            return True
    return False


def os_mappings(source: str, module: str) -> list[str]:
    """Where `source` maps an errno or an OSError subclass to something: errno constants (less
    `ERRNO_ALLOWED`), isinstance checks on OSError's subclasses, handlers of them that build an error."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{module}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "errno" \
                and node.attr.startswith("E") and (module, node.attr) not in ERRNO_ALLOWED:
            found.append(f"{where} errno.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "errno":
            found.append(f"{where} from errno import")
        elif isinstance(node, ast.Call) and _names(node.func) == ["isinstance"] and len(node.args) == 2 \
                and OS_SUBCLASSES & set(_names(node.args[1])):
            found.append(f"{where} isinstance(..., {', '.join(sorted(OS_SUBCLASSES & set(_names(node.args[1]))))})")
        elif isinstance(node, ast.ExceptHandler) and OS_SUBCLASSES & set(_names(node.type)) \
                and _builds_an_error(node.body):
            found.append(f"{where} except {', '.join(sorted(OS_SUBCLASSES & set(_names(node.type))))}")
    return found


def _modules() -> list[tuple[str, str]]:
    return [(p.relative_to(PACKAGE).as_posix(), p.read_text(encoding="utf-8")) for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_module_but_errors_maps_oserrors() -> None:
    found = [hit for module, text in _modules() if module != "errors.py" for hit in os_mappings(text, module)]
    assert found == [], "map OSErrors through errors.os_reason (the table OS_REASONS):\n" + "\n".join(found)


def test_the_scan_finds_a_mapping() -> None:
    source = """
import errno
def f(exc):
    if isinstance(exc, (ValueError, FileNotFoundError)):
        return 1
    if exc.errno == errno.ENOENT:
        return 2
    try:
        pass
    except PermissionError as e:
        raise load_error("no", "media.permission_denied", e)
    except FileNotFoundError:
        return None
"""
    assert sorted(hit.split(" ", 1)[1] for hit in os_mappings(source, "x.py")) == [
        "errno.ENOENT", "except PermissionError", "isinstance(..., FileNotFoundError)"]
    assert os_mappings("import errno\nbusy = errno.EAGAIN\n", "output/locks.py") == []
