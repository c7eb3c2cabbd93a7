"""The compact per-row memory of a run: HashSet64 (resume, duplicates) and AttemptCounts (retries)."""

from __future__ import annotations

import random

import numpy as np

from mmenc_cli.idset import AttemptCounts, HashSet64, hash_many, id_hash


def test_hashset_matches_a_python_set_through_adds_merges_and_updates() -> None:
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(150_000)]  # more than one buffer: several merges
    s, ref = HashSet64(keys[:1000]), set(keys[:1000])
    for k in keys[500:120_000]:
        assert s.add(k) == (k not in ref)
        ref.add(k)
    s.update(np.array(keys[110_000:], dtype=np.uint64))
    ref.update(keys[110_000:])
    assert len(s) == len(ref)
    assert all(k in s for k in rng.sample(keys, 2000))
    assert not any(rng.getrandbits(64) in s for _ in range(2000))
    arr = s.to_array()
    assert arr.dtype == np.uint64 and np.all(arr[1:] > arr[:-1]) and set(arr.tolist()) == ref
    assert s.nbytes <= 16 * len(s)


def test_id_hash_is_stable_and_separates_parts() -> None:
    assert id_hash("a", "image") == id_hash("a", "image")
    assert id_hash("a", "image") != id_hash("a", "text")
    assert id_hash("ab", "c") != id_hash("a", "bc")
    assert id_hash("\ud800", None) == id_hash("\ud800", "")  # lone surrogates hash, None is empty
    assert hash_many(["x", "y"], ["image", "text"]).tolist() == [id_hash("x", "image"), id_hash("y", "text")]


def test_attempt_counts_keep_the_highest_attempt_per_key() -> None:
    counts = AttemptCounts()
    assert counts.get(5) == 0 and len(counts) == 0
    for key, attempt in [(7, 1), (3, 2), (7, 3), (7, 2), (2**64 - 1, 4), (3, 1)]:
        counts.add(key, attempt)
    assert [counts.get(k) for k in (7, 3, 2**64 - 1, 4)] == [3, 2, 4, 0]
    counts.add(3, 5)  # added after a lookup: folded in on the next one
    assert counts.get(3) == 5 and len(counts) == 3
    many = AttemptCounts()
    for i in range(100_000):
        many.add(id_hash(str(i % 50_000)), 1 + i // 50_000)
    assert len(many) == 50_000 and many.get(id_hash("123")) == 2
    assert many._keys.nbytes + many._attempts.nbytes == 12 * 50_000
