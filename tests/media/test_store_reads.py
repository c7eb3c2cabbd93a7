"""Images read from an S3 bucket (a real S3 API server on localhost, through s3fs): one GetObject
each, the size limit checked from the answer, a store's refusals as the usual error codes, 503
SlowDown retried, and a chunk's images fetched at once within a bytes budget."""

from __future__ import annotations

import collections
from typing import Any, Iterator

import pytest

from mmenc_cli.config import MediaConfig
from mmenc_cli.errors import MMError
from mmenc_cli.media import fetch_ahead, load_image
from mmenc_cli.media.ahead import Budget
from tests.media.store_faults import jpeg, read_proxy
from tests.s3server import bucket, s3_server  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """S3 API calls by operation, counted by botocore's `before-call` hook on every new client."""
    import s3fs
    from aiobotocore.session import AioSession

    counted: collections.Counter[str] = collections.Counter()
    original = AioSession.__init__

    def init(self: Any, *args: Any, **kw: Any) -> None:
        original(self, *args, **kw)
        self.register("before-call.s3", lambda event_name, **_: counted.update([event_name.rsplit(".", 1)[-1]]))

    monkeypatch.setattr(AioSession, "__init__", init)
    s3fs.S3FileSystem.clear_instance_cache()  # a client made before would not count
    yield counted
    s3fs.S3FileSystem.clear_instance_cache()


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


def test_a_chunk_fetched_ahead_is_one_get_per_image(bucket: str, calls: collections.Counter[str]) -> None:
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
    assert ahead.budget.used == 0


def test_missing_and_forbidden_objects_are_their_codes(bucket: str, s3_server: str,
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
        ahead = fetch_ahead([(f"s3://{bucket}/{k}", "") for k in ("missing.jpg", "secret.jpg", "a.jpg")],
                            MediaConfig(), 1 << 20)
        fetched = [ahead.take(k) for k in range(3)]
        assert [f.error.reason if f.error else None for f in fetched] == \
            ["media.not_found", "media.permission_denied", None]
        ahead.close()
        assert ahead.budget.used == 0 and ahead.budget.turn == 3


def test_a_slowdown_is_retried_with_one_call(bucket: str, s3_server: str, calls: collections.Counter[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    put(bucket, {"a.jpg": jpeg(1)})
    with read_proxy(s3_server, faults={"a.jpg": [503]}) as proxy:
        through(proxy.url, monkeypatch)
        calls.clear()
        assert load_image(f"s3://{bucket}/a.jpg", "", MediaConfig()).size == (48, 40)
        assert proxy.count("GET", "a.jpg") == 2  # the 503, then the answer
    assert calls["GetObject"] == 1


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


def test_bodies_fetched_ahead_stay_within_the_budget(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = {f"i{k}.jpg": len(jpeg(k, (64 + 8 * k, 64))) for k in range(12)}
    put(bucket, {key: jpeg(k, (64 + 8 * k, 64)) for k, key in enumerate(sizes)})
    budget = max(sizes.values()) * 2
    peak: list[int] = []
    original = Budget.take

    async def take(self: Budget, turn: int, size: int) -> None:
        await original(self, turn, size)
        peak.append(self.used)

    monkeypatch.setattr(Budget, "take", take)
    ahead = fetch_ahead([(f"s3://{bucket}/{key}", "") for key in sizes], MediaConfig(), budget)
    got = [len(ahead.take(k).payload()) for k in range(12)]
    assert got == list(sizes.values())
    ahead.close()
    assert len(peak) == 12 and max(peak) <= budget and ahead.budget.used == 0


def test_the_image_waited_for_is_never_held_by_the_budget(bucket: str) -> None:
    """A budget smaller than one image: each goes alone, in order, and every one arrives."""
    images = {f"i{k}.jpg": jpeg(k) for k in range(6)}
    put(bucket, images)
    ahead = fetch_ahead([(f"s3://{bucket}/{key}", "") for key in images], MediaConfig(), 1)
    assert [ahead.take(k).payload() for k in range(6)] == list(images.values())


def test_the_media_client_is_bounded_like_the_output_one(bucket: str) -> None:
    """The same timeouts and retries as the output's store client, and a connection per GET in flight."""
    from mmenc_cli.media.ahead import FetchAhead
    from mmenc_cli.media.stores import POOL_CONNECTIONS, filesystem
    from mmenc_cli.output.objectstore import client_options

    fs, inner = filesystem(f"s3://{bucket}/a.jpg")
    assert inner == f"{bucket}/a.jpg"
    bounded = client_options("s3", None)["config_kwargs"]
    assert fs.config_kwargs == {**bounded, "max_pool_connections": POOL_CONNECTIONS}
    assert POOL_CONNECTIONS >= 32 and isinstance(fetch_ahead([], MediaConfig(), 1), FetchAhead)
