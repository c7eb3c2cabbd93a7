"""A proxy in front of the S3 server for reading tests: it answers chosen GETs with a store's
error (503 SlowDown, 403 AccessDenied), can hold every GET a while, and records each request and
the most GETs it had in flight at once. Built on `tests/s3server.py`'s forwarding proxy."""

from __future__ import annotations

import collections
import io
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from tests.s3server import _Handler, _Proxy, send_error_xml

ERRORS = {503: ("SlowDown", "Please reduce your request rate."), 403: ("AccessDenied", "Access Denied")}


class ReadProxy(_Proxy):
    """`faults`: key suffix -> a list of statuses to answer its next GETs with (consumed in order)."""

    def __init__(self, target: str, faults: dict[str, list[int]] | None = None, delay: float = 0.0) -> None:
        super().__init__(target, "pass", 0)
        self.RequestHandlerClass = _FaultHandler
        self.faults = {k: list(v) for k, v in (faults or {}).items()}
        self.delay = delay
        self.requests: list[tuple[str, str]] = []
        self.gets_now = self.most_gets = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def fault(self, method: str, path: str) -> int | None:
        with self.lock:
            self.requests.append((method, path.split("?", 1)[0]))
            if method != "GET":
                return None
            key = next((k for k in self.faults if path.split("?", 1)[0].endswith(k)), None)
            return self.faults[key].pop(0) if key is not None and self.faults[key] else None

    def count(self, method: str, suffix: str = "") -> int:
        """Requests seen with `method` whose path ends with `suffix`."""
        return sum(1 for m, p in self.requests if m == method and p.endswith(suffix))

    def methods(self) -> collections.Counter[str]:
        return collections.Counter(m for m, _ in self.requests)

    def gets(self, delta: int) -> None:
        with self.lock:
            self.gets_now += delta
            self.most_gets = max(self.most_gets, self.gets_now)


class _FaultHandler(_Handler):
    server: ReadProxy

    def _answer(self) -> None:
        status = self.server.fault(self.command, self.path)
        if status is None:
            is_get = self.command == "GET"
            if is_get:
                self.server.gets(1)
            try:
                if is_get and self.server.delay:
                    time.sleep(self.server.delay)
                self._forward()
            finally:
                if is_get:
                    self.server.gets(-1)
            return
        send_error_xml(self, status, *ERRORS[status])

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer


@contextmanager
def read_proxy(target: str, faults: dict[str, list[int]] | None = None, delay: float = 0.0) -> Iterator[ReadProxy]:
    """A `ReadProxy` to `target`, serving on a thread while the block runs."""
    server = ReadProxy(target, faults, delay)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def jpeg(index: int, size: tuple[int, int] = (48, 40)) -> bytes:
    """A small JPEG whose colour depends on `index`."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (index * 37 % 256, index * 91 % 256, 128)).save(buf, "JPEG")
    return buf.getvalue()
