"""Memory is bounded by the items in flight, not by the shard size: a row's inline media bytes
(tar members, Parquet image bytes) are let go once sent to the decode workers, and the undecoded
bytes waiting and in the workers stay within `--max-inflight-bytes`."""

from __future__ import annotations

import collections
import gc
import io
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from PIL import Image

from mmenc_cli.config import BatchConfig, ConfigError
from mmenc_cli.encoders.base import ImageInput
from mmenc_cli.records import Item, ManifestRow
from mmenc_cli.run.commit import ShardCommitter
from mmenc_cli.run.counters import Counters
from mmenc_cli.run.decode_worker import Decoded
from mmenc_cli.run.media_feed import MediaFeed
from mmenc_cli.run.pipeline import run_encode
from tests.fakes import FakeEncoder, factory
from tests.readers.test_inputs import write_tar
from tests.runs import error_rows, make_cfg

SIZE = 150_000  # every member's size, so the test can find them among all live objects


def member(i: int) -> bytes:
    """A small JPEG padded after its end to SIZE bytes (Pillow decodes the JPEG, the rest travels)."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 12), (i * 20 % 256, 90, 200)).save(buf, "JPEG")
    return buf.getvalue() + bytes([i % 256]) * (SIZE - len(buf.getvalue()))


def payloads_alive() -> int:
    """How many member-sized bytes objects any live container still refers to."""
    gc.collect()
    found = set()
    for obj in gc.get_objects():
        for ref in gc.get_referents(obj):
            if type(ref) is bytes and len(ref) == SIZE:
                found.add(id(ref))
    return len(found)


def watch_commits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """At each shard handed to the writer: (inline bytes its rows hold, member payloads alive)."""
    seen: list[tuple[int, int]] = []
    real = ShardCommitter.flush

    def flush(self: ShardCommitter) -> None:
        if len(self.shard):
            held = sum(len(v) for row in self.shard.refs for m in ("image", "audio", "video")
                       if isinstance(v := row.value(m), bytes))
            seen.append((held, payloads_alive()))
        real(self)

    monkeypatch.setattr(ShardCommitter, "flush", flush)
    return seen


def test_a_tar_members_bytes_are_let_go_before_their_shard_commits(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    members = [(f"k{i:02d}.jpg", member(i)) for i in range(12)] + [("bad.jpg", b"\0" * SIZE)]
    shard = write_tar(tmp_path / "00000.tar", members)
    del members
    seen = watch_commits(monkeypatch)
    res = run_encode(make_cfg([shard], tmp_path / "out", shard_size=5), encoder_factory=factory(FakeEncoder()))
    assert res.counters.balanced and res.counters.mod("image").encoded == 12
    assert [held for held, _ in seen] == [0, 0, 0]  # shards of 5, 5, 2: no row keeps its member
    assert seen[-1][1] <= 1  # at the last commit every member is decoded: none alive (but the loop's last row)
    [err] = error_rows(tmp_path / "out")  # the report still says what the member was
    assert err["id"] == "bad" and err["source"] == f"<{SIZE} bytes inline>" and err["code"] == 400


def test_parquet_rows_with_a_text_keep_no_image_bytes_until_the_commit(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 10
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "image": [member(i) for i in range(n)],
                             "text": [f"caption {i}" for i in range(n)]}), tmp_path / "m.parquet")
    seen = watch_commits(monkeypatch)
    res = run_encode(make_cfg([tmp_path / "m.parquet"], tmp_path / "out", shard_size=100),
                     encoder_factory=factory(FakeEncoder()))
    assert res.counters.mod("image").encoded == n and res.counters.mod("text").encoded == n
    [(held, alive)] = seen  # the texts wait for the end of their window: their rows once held the images
    assert held == 0 and alive <= 1


def test_a_row_released_keeps_what_the_report_and_retry_need() -> None:
    from mmenc_cli.run.media_feed import released

    row = ManifestRow("a", "m.tar", 3, 512, image=b"x" * 10, text="t", keep={"k": 1}, audio="a.wav")
    light = released(row)
    assert (light.id, light.manifest, light.line, light.offset, light.text, light.keep, light.audio) == \
        ("a", "m.tar", 3, 512, "t", {"k": 1}, "a.wav")
    assert light.image == "<10 bytes inline>" and row.image == b"x" * 10
    plain = ManifestRow("b", "m.jsonl", 1, 0, image="b.jpg")
    assert released(plain) is plain


def inline_bytes(source: Any) -> int:
    return len(source) if isinstance(source, bytes) else 0


class HoldingPool:
    """A decode pool that finishes nothing until drained: the worst case for the bytes budget.
    It keeps each chunk's sources, as the real pool does until their results are collected."""

    stop = None

    def __init__(self) -> None:
        self.pending: collections.deque[tuple[Any, list[tuple[Any, str]]]] = collections.deque()
        self.chunks: list[int] = []  # items per chunk sent

    @property
    def in_flight(self) -> int:
        return sum(len(sources) for _, sources in self.pending)

    def held(self) -> int:
        return sum(inline_bytes(src) for _, sources in self.pending for src, _ in sources)

    def submit(self, key: Any, sources: list[tuple[Any, str]], cpu_only: bool = False, modality: str = "image") -> None:
        self.pending.append((key, list(sources)))
        self.chunks.append(len(sources))

    def ready(self) -> Iterator[Any]:
        return iter(())

    def drain(self) -> Iterator[Any]:
        while self.pending:
            key, sources = self.pending.popleft()
            yield key, [Decoded(ImageInput(np.zeros((2, 2, 3), np.uint8), {}), None, (0.0, 0.0)) for _ in sources]

    def release(self, decoded: Decoded) -> None:
        pass

    def close(self, kill: bool = False) -> None:
        pass


def test_the_undecoded_bytes_waiting_and_in_the_pool_stay_within_the_budget() -> None:
    pool, encoded = HoldingPool(), []
    feed = MediaFeed(lambda: pool, {"image": 8}, None, Counters(), None,  # type: ignore[arg-type]
                     lambda modality, items, payloads: encoded.extend(items), max_bytes=1000, chunk_bytes=250)
    row = ManifestRow("r", "m", 1, 0)
    for i in range(50):
        item = Item(row, "image", source=bytes(100))
        feed.add(item)
        waiting = sum(inline_bytes(it.source) for chunk in feed.chunks.values() for it in chunk)
        assert pool.held() + waiting <= 1000
        assert feed.held_bytes == pool.held() + waiting
    assert set(pool.chunks) == {2}  # a chunk stays within its share of the budget (the count says 8)
    feed.add(Item(row, "image", source=bytes(2500)))  # larger than the budget: it waits for room, then goes alone
    waiting = sum(inline_bytes(it.source) for chunk in feed.chunks.values() for it in chunk)
    assert pool.held() + waiting == 2500
    assert [len(sources) for _, sources in pool.pending] == [1]
    feed.add(Item(row, "image", source="a/path.jpg"))  # a path counts nothing: it never waits for room
    assert pool.held() == 2500
    feed.add(Item(row, "image", source=bytes(100)))  # this one waits for the large one to be decoded
    waiting = sum(inline_bytes(it.source) for chunk in feed.chunks.values() for it in chunk)
    assert pool.held() + waiting == 100 == feed.held_bytes
    feed.finish()
    assert len(encoded) == 53 and feed.held_bytes == 0 and pool.held() == 0
    assert all(item.source is None for item in encoded)  # nothing sent keeps its payload


def test_the_budget_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--max-inflight-bytes"):
        BatchConfig(max_inflight_bytes=0)
