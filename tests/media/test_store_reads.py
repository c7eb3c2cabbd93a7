"""Images read from an S3 bucket (a real S3 API server on localhost, through s3fs): one GetObject
each, the size limit checked from the answer, a store's refusals as the usual error codes, 503
SlowDown retried, and a chunk's images fetched at once within a bytes budget: on threads sharing a
plain botocore client, or on s3fs's event loop where the filesystem's options are not mapped."""

from __future__ import annotations

import collections
from typing import Any, Iterator

import pytest

from mmenc_cli.config import MediaConfig
from mmenc_cli.errors import MMError
from mmenc_cli.media import fetch_ahead, load_image
from mmenc_cli.media import ahead as ahead_module
from mmenc_cli.media.ahead import Budget, ThreadBudget
from tests.media.store_faults import jpeg, read_proxy
from tests.s3server import bucket, s3_server  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """S3 API calls by operation, counted by botocore's `before-call` hook on every new client
    (botocore's sessions and aiobotocore's, made through botocore's)."""
    import s3fs
    from botocore.session import Session

    counted: collections.Counter[str] = collections.Counter()
    original = Session.__init__

    def init(self: Any, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        self.register("before-call.s3", lambda event_name, **_: counted.update([event_name.rsplit(".", 1)[-1]]))

    monkeypatch.setattr(Session, "__init__", init)
    s3fs.S3FileSystem.clear_instance_cache()  # a client made before would not count
    yield counted
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(params=["threads", "loop"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a chunk's GETs run: on threads (the default), or on s3fs's loop (no plain client for the filesystem)."""
    if request.param == "loop":
        monkeypatch.setattr(ahead_module, "blocking_client", lambda fs: None)
    return str(request.param)


def put(bucket: str, objects: dict[str, bytes]) -> None:
    import s3fs

    fs = s3fs.S3FileSystem()
    for key, data in objects.items():
        fs.pipe(f"{bucket}/{key}", data)


def error(source: str, cfg: MediaConfig = MediaConfig()) -> MMError:
    with pytest.raises(MMError) as caught:
        load_image(source, "", cfg)
    return caught.value


def through(proxy_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's store clients go through the proxy from now on."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy_url)
    s3fs.S3FileSystem.clear_instance_cache()


def test_an_image_in_a_bucket_is_one_get(bucket: str, calls: collections.Counter[str]) -> None:
    put(bucket, {"a.jpg": jpeg(1), "pics/b.jpg": jpeg(2)})
    calls.clear()
    assert load_image(f"s3://{bucket}/a.jpg", "", MediaConfig()).size == (48, 40)
    assert dict(calls) == {"GetObject": 1}
    calls.clear()
    assert load_image("b.jpg", f"s3://{bucket}/pics", MediaConfig()).size == (48, 40)  # relative to a store folder
    assert dict(calls) == {"GetObject": 1}


def test_a_chunk_fetched_ahead_is_one_get_per_image(bucket: str, calls: collections.Counter[str], mode: str) -> None:
    images = {f"i{k}.jpg": jpeg(k) for k in range(20)}
    put(bucket, images)
    calls.clear()
    sources = [(f"s3://{bucket}/i{k}.jpg", "") for k in range(20)] + [("local.jpg", "/nowhere")]
    ahead = fetch_ahead(sources, MediaConfig(), 1 << 20)
    assert 20 not in ahead  # a local path is read in place
    got = [ahead.take(k).payload() for k in range(20)]
    assert got == [images[f"i{k}.jpg"] for k in range(20)]
    assert dict(calls) == {"GetObject": 20}
    ahead.close()
    assert ahead.budget.used == 0 and isinstance(ahead.budget, ThreadBudget if mode == "threads" else Budget)


def test_missing_and_forbidden_objects_are_their_codes(bucket: str, s3_server: str, mode: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    put(bucket, {"a.jpg": jpeg(1), "secret.jpg": jpeg(2), "empty.jpg": b"", "dir/x.jpg": jpeg(3)})
    with read_proxy(s3_server, faults={"secret.jpg": [403] * 20}) as proxy:
        through(proxy.url, monkeypatch)
        missing = error(f"s3://{bucket}/missing.jpg")
        assert (missing.code, missing.reason, missing.stage) == (404, "media.not_found", "load")
        assert f"s3://{bucket}/missing.jpg does not exist" in missing.message
        forbidden = error(f"s3://{bucket}/secret.jpg")
        assert (forbidden.code, forbidden.reason) == (403, "media.permission_denied")
        empty = error(f"s3://{bucket}/empty.jpg")
        assert (empty.code, empty.reason) == (400, "media.empty")
        assert error(f"s3://{bucket}/dir").reason == "media.is_directory"
        keys = ("missing.jpg", "secret.jpg", "a.jpg", "dir", "empty.jpg")
        ahead = fetch_ahead([(f"s3://{bucket}/{k}", "") for k in keys], MediaConfig(), 1 << 20)
        fetched = [ahead.take(k) for k in range(5)]
        assert [f.error.reason if f.error else None for f in fetched] == \
            ["media.not_found", "media.permission_denied", None, "media.is_directory", "media.empty"]
        assert (fetched[0].error.code, fetched[1].error.code) == (404, 403)  # type: ignore[union-attr]
        ahead.close()
        assert ahead.budget.used == 0 and ahead.budget.turn == 5


def test_a_slowdown_is_retried_with_one_call(bucket: str, s3_server: str, calls: collections.Counter[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    put(bucket, {"a.jpg": jpeg(1)})
    with read_proxy(s3_server, faults={"a.jpg": [503]}) as proxy:
        through(proxy.url, monkeypatch)
        calls.clear()
        assert load_image(f"s3://{bucket}/a.jpg", "", MediaConfig()).size == (48, 40)
        assert proxy.count("GET", "a.jpg") == 2  # the 503, then the answer
        assert calls["GetObject"] == 1
    with read_proxy(s3_server, faults={"a.jpg": [503]}) as proxy:  # fetched ahead on threads: botocore retries
        through(proxy.url, monkeypatch)
        calls.clear()
        ahead = fetch_ahead([(f"s3://{bucket}/a.jpg", "")], MediaConfig(), 1 << 20)
        assert ahead.take(0).payload() == jpeg(1) and isinstance(ahead.budget, ThreadBudget)
        assert proxy.count("GET", "a.jpg") == 2 and dict(calls) == {"GetObject": 1}


def test_an_object_over_the_limit_is_413_from_its_header(bucket: str, calls: collections.Counter[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from aiobotocore.response import StreamingBody

    big = b"\xff" * (3 << 20)
    put(bucket, {"big.jpg": big})
    read: list[int] = []
    original = StreamingBody.read

    async def counted_read(self: Any, *args: Any, **kw: Any) -> bytes:
        data = await original(self, *args, **kw)
        read.append(len(data))
        return data

    monkeypatch.setattr(StreamingBody, "read", counted_read)
    calls.clear()
    err = error(f"s3://{bucket}/big.jpg", MediaConfig(max_file_bytes=1 << 20))
    assert (err.code, err.reason) == (413, "media.file_too_large")
    assert f"({3 << 20} > {1 << 20})" in err.message  # the whole size: known from Content-Length only
    assert read == [] and dict(calls) == {"GetObject": 1}  # its body never read


def test_an_object_over_the_limit_fetched_ahead_is_413_unread(bucket: str, calls: collections.Counter[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.response import StreamingBody

    put(bucket, {"big.jpg": b"\xff" * (3 << 20), "a.jpg": jpeg(1)})
    read: list[int] = []
    original = StreamingBody.read
    monkeypatch.setattr(StreamingBody, "read", lambda self, *a, **kw: read.append(1) or original(self, *a, **kw))
    calls.clear()
    ahead = fetch_ahead([(f"s3://{bucket}/big.jpg", ""), (f"s3://{bucket}/a.jpg", "")],
                        MediaConfig(max_file_bytes=1 << 20), 1 << 20)
    big, small = ahead.take(0), ahead.take(1)
    assert big.error is not None and (big.error.code, big.error.reason) == (413, "media.file_too_large")
    assert small.payload() == jpeg(1) and read == [1]  # only the small one's body read
    assert dict(calls) == {"GetObject": 2} and ahead.budget.used == 0


def test_bodies_fetched_ahead_stay_within_the_budget(bucket: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = {f"i{k}.jpg": len(jpeg(k, (64 + 8 * k, 64))) for k in range(12)}
    put(bucket, {key: jpeg(k, (64 + 8 * k, 64)) for k, key in enumerate(sizes)})
    budget = max(sizes.values()) * 2
    peak: list[int] = []
    original, threaded = Budget.take, ThreadBudget.take

    async def take(self: Budget, turn: int, size: int) -> None:
        await original(self, turn, size)
        peak.append(self.used)

    def thread_take(self: ThreadBudget, turn: int, size: int) -> None:
        threaded(self, turn, size)
        peak.append(self.used)

    monkeypatch.setattr(Budget, "take", take)
    monkeypatch.setattr(ThreadBudget, "take", thread_take)
    ahead = fetch_ahead([(f"s3://{bucket}/{key}", "") for key in sizes], MediaConfig(), budget)
    got = [len(ahead.take(k).payload()) for k in range(12)]
    assert got == list(sizes.values())
    ahead.close()
    assert len(peak) == 12 and max(peak) <= budget and ahead.budget.used == 0


def test_the_image_waited_for_is_never_held_by_the_budget(bucket: str, mode: str) -> None:
    """A budget smaller than one image: each goes alone, in order, and every one arrives."""
    images = {f"i{k}.jpg": jpeg(k) for k in range(6)}
    put(bucket, images)
    ahead = fetch_ahead([(f"s3://{bucket}/{key}", "") for key in images], MediaConfig(), 1)
    assert [ahead.take(k).payload() for k in range(6)] == list(images.values())


def test_the_media_client_is_bounded_like_the_output_one(bucket: str) -> None:
    """The same timeouts and retries as the output's store client, and a connection per GET in flight."""
    from mmenc_cli.media.ahead import FetchAhead
    from mmenc_cli.media.stores import POOL_CONNECTIONS, blocking_client, filesystem
    from mmenc_cli.output.objectstore import client_options

    fs, inner = filesystem(f"s3://{bucket}/a.jpg")
    assert inner == f"{bucket}/a.jpg"
    bounded = client_options("s3", None)["config_kwargs"]
    assert fs.config_kwargs == {**bounded, "max_pool_connections": POOL_CONNECTIONS}
    assert POOL_CONNECTIONS >= 32 and isinstance(fetch_ahead([], MediaConfig(), 1), FetchAhead)
    config = blocking_client(fs).meta.config  # the threads' plain client: the same bounds
    assert (config.connect_timeout, config.read_timeout, config.retries) == \
        (bounded["connect_timeout"], bounded["read_timeout"], bounded["retries"])
    assert config.max_pool_connections >= ahead_module.THREADS


def test_options_a_plain_client_does_not_map_are_read_through_s3fs() -> None:
    """Requester pays (an option the plain client does not map): no such client, so a chunk's GETs run
    on s3fs's loop (as in the `mode` "loop" tests above)."""
    import s3fs

    from mmenc_cli.media.stores import blocking_client

    assert blocking_client(s3fs.S3FileSystem(requester_pays=True)) is None
    assert blocking_client(s3fs.S3FileSystem(config_kwargs={"max_pool_connections": 4})) is not None
