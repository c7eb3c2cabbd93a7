"""Unit tests of `mmenc_cli.batching`: micro-batches, bisection, OOM back-off and regrowth.

The encoder is a small fake `encode_fn(modality, payloads) -> EncodeOutput` whose vectors are a
pure function of the payload (an int), so every outcome can be checked against its payload and
every call it received is recorded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import pytest
import torch

from mmenc_cli.batching import BatchRunner, Outcome, _to_numpy
from mmenc_cli.encoders.base import EncodeOutput
from mmenc_cli.errors import MMError, is_out_of_memory

DIM = 4


class Poisoned(ValueError):
    """What the fake encoder raises for a batch holding a poisoned payload."""


class CudaOOM(RuntimeError):
    """Looks like torch's CUDA out-of-memory error to `errors.is_out_of_memory`."""

    def __init__(self, n: int) -> None:
        super().__init__(f"CUDA out of memory. Tried to allocate 2.00 GiB for a batch of {n}")


def vec(p: int) -> np.ndarray:
    """The expected embedding of payload `p`."""
    return np.arange(DIM, dtype=np.float32) + 10.0 * p


@dataclass
class FakeEncode:
    """A configurable `encode_fn`; payloads are ints, `calls` records every batch it got."""

    poison: set[int] = field(default_factory=set)  # raise Poisoned when a batch holds one
    oom_above: int | None = None  # raise CudaOOM for batches larger than this (while `pressure`)
    pressure: bool = True
    oom_on: set[int] = field(default_factory=set)  # raise CudaOOM whenever a batch holds one
    drop_on: set[int] = field(default_factory=set)  # return one output too few for such batches
    nan_on: dict[int, float] = field(default_factory=dict)  # payload -> value put in its row
    truncate: set[int] = field(default_factory=set)  # payloads reported as truncated
    calls: list[list[int]] = field(default_factory=list)

    def __call__(self, modality: str, payloads: Sequence[int]) -> EncodeOutput:
        batch = list(payloads)
        self.calls.append(batch)
        if self.pressure and self.oom_above is not None and len(batch) > self.oom_above:
            raise CudaOOM(len(batch))
        if self.oom_on & set(batch):
            raise CudaOOM(len(batch))
        if self.poison & set(batch):
            raise Poisoned(f"cannot encode {sorted(self.poison & set(batch))}")
        rows = np.stack([vec(p) for p in batch])
        for i, p in enumerate(batch):
            if p in self.nan_on:
                rows[i, 1] = self.nan_on[p]
        if self.drop_on & set(batch):
            rows = rows[:-1]
        return EncodeOutput(torch.from_numpy(rows), [p in self.truncate for p in batch])

    @property
    def sizes(self) -> list[int]:
        return [len(c) for c in self.calls]


def assert_ok(outcomes: list[Outcome], payloads: Sequence[int], skip: Sequence[int] = ()) -> None:
    """Every outcome except those at positions `skip` holds the vector of its payload."""
    assert len(outcomes) == len(payloads)
    for i, (o, p) in enumerate(zip(outcomes, payloads)):
        if i in skip:
            continue
        assert o.error is None, (i, o.error)
        assert o.value is not None and o.value.dtype == np.float32
        np.testing.assert_array_equal(o.value, vec(p))


def test_fake_oom_is_recognised() -> None:
    """The fake OOM must look like torch's to the code under test, else the OOM tests test nothing."""
    assert is_out_of_memory(CudaOOM(3))
    assert not is_out_of_memory(Poisoned("x"))


# -- micro-batches --------------------------------------------------------------------------

def test_micro_batches_and_order() -> None:
    enc = FakeEncode()
    runner = BatchRunner(enc, batch_size=4)
    payloads = [7, 3, 9, 1, 0, 5, 2, 8, 6, 4]
    outcomes = runner.run("text", payloads)
    assert enc.calls == [[7, 3, 9, 1], [0, 5, 2, 8], [6, 4]]
    assert_ok(outcomes, payloads)
    assert all(isinstance(o, Outcome) and o.truncated is False for o in outcomes)
    assert runner.stats.calls == 3
    assert runner.stats.bisections == 0 and runner.stats.oom_halvings == 0
    assert runner.size("text") == 4


def test_modality_is_passed_through() -> None:
    seen: list[str] = []

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        seen.append(modality)
        return EncodeOutput(torch.from_numpy(np.stack([vec(p) for p in payloads])))

    BatchRunner(encode, batch_size=2).run("image", [1, 2, 3])
    assert seen == ["image", "image"]


def test_empty_input() -> None:
    enc = FakeEncode()
    assert BatchRunner(enc, batch_size=4).run("text", []) == []
    assert enc.calls == []


def test_outcomes_of_one_run_do_not_alias() -> None:
    """Each row is its own vector, even when rows are views of one [n, dim] array."""
    outcomes = BatchRunner(FakeEncode(), batch_size=8).run("text", [1, 2, 3])
    assert [o.value.shape for o in outcomes] == [(DIM,)] * 3
    np.testing.assert_array_equal(outcomes[2].value, vec(3))


# -- bisection --------------------------------------------------------------------------------

def test_poisoned_payload_is_isolated_by_bisection() -> None:
    enc = FakeEncode(poison={5})
    runner = BatchRunner(enc, batch_size=8)
    payloads = list(range(8))
    outcomes = runner.run("text", payloads)

    assert_ok(outcomes, payloads, skip=[5])
    err = outcomes[5].error
    assert isinstance(err, MMError) and outcomes[5].value is None
    assert (err.reason, err.code, err.stage, err.error) == ("encode.failed", 500, "encode", "Poisoned")
    assert "cannot encode [5]" in err.message
    # 8 fails -> [0:4] ok, [4:8] fails -> [4:6] fails -> [4] ok, [5] fails; [6:8] ok
    assert enc.calls == [list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], [4, 5], [4], [5], [6, 7]]
    assert runner.stats.bisections == 3
    assert runner.size("text") == 8  # a plain failure never shrinks the batch size
    assert runner.stats.oom_halvings == 0


def test_two_poisoned_payloads_in_different_batches() -> None:
    enc = FakeEncode(poison={0, 6})
    payloads = list(range(7))
    outcomes = BatchRunner(enc, batch_size=3).run("text", payloads)
    assert_ok(outcomes, payloads, skip=[0, 6])
    assert [o.error.reason for o in (outcomes[0], outcomes[6])] == ["encode.failed"] * 2
    assert enc.calls[0] == [0, 1, 2]
    assert [6] in enc.calls


def test_output_count_mismatch_bisects_to_the_guilty_item() -> None:
    enc = FakeEncode(drop_on={2})
    runner = BatchRunner(enc, batch_size=4)
    payloads = [0, 1, 2, 3]
    outcomes = runner.run("text", payloads)
    assert_ok(outcomes, payloads, skip=[2])
    err = outcomes[2].error
    assert (err.reason, err.code, err.stage) == ("encode.output_count", 500, "encode")
    assert "0 outputs for 1 inputs" in err.message
    assert enc.calls == [[0, 1, 2, 3], [0, 1], [2, 3], [2], [3]]
    assert runner.stats.bisections == 2


# -- out of memory ----------------------------------------------------------------------------

def test_oom_halves_batch_size_without_failing_anything() -> None:
    freed: list[int] = []
    enc = FakeEncode(oom_above=2)
    runner = BatchRunner(enc, batch_size=8, grow_after=100, free_memory=lambda: freed.append(1))
    payloads = list(range(16))
    outcomes = runner.run("image", payloads)

    assert_ok(outcomes, payloads)
    assert runner.size("image") == 2
    assert runner.stats.regrowths == 0
    # 8 -> OOM, 4 -> OOM, then [4:8] of the first top batch tries 4 once more
    assert enc.sizes == [8, 4, 2, 2, 4, 2, 2, 2, 2, 2, 2]
    assert runner.stats.oom_halvings == 3
    assert len(freed) == 3
    assert runner.stats.events == ["out of memory at batch size 8: halving to 4",
                                   "out of memory at batch size 4: halving to 2",
                                   "out of memory at batch size 4: halving to 2"]
    assert runner.stats.bisections == 0  # OOM halving is not counted as a bisection


def test_batch_size_grows_back_after_grow_after_successes() -> None:
    enc = FakeEncode(oom_above=2)
    runner = BatchRunner(enc, batch_size=8, grow_after=3)
    first = list(range(8))
    assert_ok(runner.run("text", first), first)
    assert runner.size("text") == 2
    assert runner.stats.oom_halvings == 3 and runner.stats.regrowths == 0

    enc.pressure = False  # memory is back
    enc.calls.clear()
    second = list(range(100, 112))
    assert_ok(runner.run("text", second), second)
    # the 3rd success since the last OOM doubles 2 -> 4, three more double 4 -> 8
    assert enc.sizes == [2, 4, 4, 2]
    assert runner.size("text") == 8
    assert runner.stats.regrowths == 2
    assert runner.stats.events[-2:] == [
        "3 batches without running out of memory: growing batch size 2 -> 4",
        "3 batches without running out of memory: growing batch size 4 -> 8"]

    enc.calls.clear()
    third = list(range(200, 224))
    runner.run("text", third)
    assert enc.sizes == [8, 8, 8]  # never above the configured size
    assert runner.size("text") == 8 and runner.stats.regrowths == 2


def test_growth_is_capped_at_configured_size() -> None:
    """A configured size that is not a power of two: growth stops there, not at the next double."""
    enc = FakeEncode(oom_above=2)
    runner = BatchRunner(enc, batch_size=6, grow_after=1)
    runner.run("text", list(range(6)))  # 6 -> OOM (3), 3 -> OOM (1) ... then regrows
    enc.pressure = False
    runner.run("text", list(range(30)))
    assert runner.size("text") == 6
    assert max(enc.sizes) == 6


def test_single_item_out_of_memory_alone_fails_with_507() -> None:
    freed: list[int] = []
    enc = FakeEncode(oom_on={1})
    runner = BatchRunner(enc, batch_size=4, free_memory=lambda: freed.append(1))
    payloads = [0, 1, 2, 3]
    outcomes = runner.run("image", payloads)

    assert_ok(outcomes, payloads, skip=[1])
    errors = [o.error for o in outcomes if o.error is not None]
    assert len(errors) == 1
    err = outcomes[1].error
    assert (err.reason, err.code, err.stage, err.error) == ("encode.out_of_memory", 507, "encode", "CudaOOM")
    assert err.message.startswith("out of memory with this item alone:")
    assert "CUDA out of memory" in err.message
    assert enc.calls == [[0, 1, 2, 3], [0, 1], [0], [1], [2, 3]]
    assert len(freed) == 3  # batch of 4, batch of 2, the item alone
    assert runner.stats.oom_halvings == 2


def test_memory_error_is_treated_like_oom() -> None:
    calls: list[int] = []

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        calls.append(len(payloads))
        if len(payloads) > 1:
            raise MemoryError()
        return EncodeOutput(torch.from_numpy(np.stack([vec(p) for p in payloads])))

    runner = BatchRunner(encode, batch_size=2, grow_after=100)
    outcomes = runner.run("text", [4, 5])
    assert_ok(outcomes, [4, 5])
    assert runner.size("text") == 1 and runner.stats.oom_halvings == 1


# -- per-row results --------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_row_fails_only_that_row(bad: float) -> None:
    enc = FakeEncode(nan_on={2: bad})
    runner = BatchRunner(enc, batch_size=4)
    payloads = [0, 1, 2, 3]
    outcomes = runner.run("text", payloads)
    assert_ok(outcomes, payloads, skip=[2])
    assert outcomes[2].value is None
    err = outcomes[2].error
    assert (err.reason, err.code, err.stage) == ("encode.non_finite", 500, "encode")
    assert enc.calls == [payloads]  # no bisection for a non-finite row


def test_check_error_fails_only_that_item() -> None:
    seen: list[tuple[str, list[int], int]] = []

    def check(modality: str, payloads: Sequence[int], vectors: list[np.ndarray]) -> list[MMError | None]:
        seen.append((modality, list(payloads), len(vectors)))
        return [MMError(f"bad {p}", reason="encode.token_mismatch") if p == 3 else None for p in payloads]

    payloads = [1, 2, 3, 4, 5]
    outcomes = BatchRunner(FakeEncode(), batch_size=3, check=check).run("image", payloads)
    assert_ok(outcomes, payloads, skip=[2])
    assert outcomes[2].value is None
    assert (outcomes[2].error.reason, outcomes[2].error.code, outcomes[2].error.message) == \
        ("encode.token_mismatch", 500, "bad 3")
    assert seen == [("image", [1, 2, 3], 3), ("image", [4, 5], 2)]


def test_check_returning_none_means_no_errors() -> None:
    calls: list[int] = []

    def check(modality: str, payloads: Sequence[int], vectors: list[np.ndarray]) -> None:
        calls.append(len(payloads))
        return None

    payloads = [1, 2, 3]
    outcomes = BatchRunner(FakeEncode(), batch_size=2, check=check).run("text", payloads)
    assert_ok(outcomes, payloads)
    assert calls == [2, 1]


def test_check_error_wins_over_non_finite() -> None:
    def check(modality: str, payloads: Sequence[int], vectors: list[np.ndarray]) -> list[MMError | None]:
        return [MMError("from check", reason="encode.token_mismatch") for _ in payloads]

    outcomes = BatchRunner(FakeEncode(nan_on={0: math.nan}), batch_size=2, check=check).run("text", [0])
    assert outcomes[0].error.reason == "encode.token_mismatch"


def test_truncated_flags_reach_outcomes() -> None:
    enc = FakeEncode(truncate={2, 5})
    payloads = [1, 2, 3, 4, 5]
    outcomes = BatchRunner(enc, batch_size=2).run("text", payloads)
    assert [o.truncated for o in outcomes] == [False, True, False, False, True]
    assert_ok(outcomes, payloads)


def test_truncated_flags_survive_bisection() -> None:
    enc = FakeEncode(truncate={1, 3}, poison={2})
    outcomes = BatchRunner(enc, batch_size=4).run("text", [0, 1, 2, 3])
    assert [o.truncated for o in outcomes] == [False, True, False, True]
    assert outcomes[2].error.reason == "encode.failed"


def test_empty_truncated_list_means_not_truncated() -> None:
    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        return EncodeOutput(torch.from_numpy(np.stack([vec(p) for p in payloads])), [])

    outcomes = BatchRunner(encode, batch_size=4).run("image", [1, 2])
    assert [o.truncated for o in outcomes] == [False, False]


# -- token outputs ----------------------------------------------------------------------------

def token_encode(lengths: dict[int, int], nan_on: int | None = None) -> Callable[[str, Sequence[int]], EncodeOutput]:
    """An encode_fn returning one [lengths[p], DIM] tensor per payload p (bfloat16, to check widening)."""

    def encode(modality: str, payloads: Sequence[int]) -> EncodeOutput:
        out = []
        for p in payloads:
            t = torch.full((lengths[p], DIM), float(p), dtype=torch.bfloat16)
            if p == nan_on:
                t[-1, -1] = float("nan")
            out.append(t)
        return EncodeOutput(out)

    return encode


def test_token_outputs_become_float32_arrays_of_their_shapes() -> None:
    lengths = {1: 3, 2: 5, 3: 1}
    outcomes = BatchRunner(token_encode(lengths), batch_size=2).run("image", [1, 2, 3])
    assert [o.error for o in outcomes] == [None, None, None]
    assert [o.value.shape for o in outcomes] == [(3, DIM), (5, DIM), (1, DIM)]
    for o, p in zip(outcomes, [1, 2, 3]):
        assert isinstance(o.value, np.ndarray) and o.value.dtype == np.float32
        np.testing.assert_array_equal(o.value, np.full((lengths[p], DIM), p, np.float32))


def test_non_finite_token_output_fails_only_that_item() -> None:
    outcomes = BatchRunner(token_encode({1: 2, 2: 4}, nan_on=2), batch_size=2).run("image", [1, 2])
    assert outcomes[0].error is None and outcomes[0].value.shape == (2, DIM)
    assert outcomes[1].value is None and outcomes[1].error.reason == "encode.non_finite"


# -- _to_numpy --------------------------------------------------------------------------------

def test_to_numpy_pooled_tensor() -> None:
    t = torch.tensor([[1.0, 2.0], [float("inf"), 0.0], [3.0, 4.0]], dtype=torch.float16)
    rows, finite = _to_numpy(t)
    assert finite == [True, False, True]
    assert len(rows) == 3 and all(r.dtype == np.float32 and r.shape == (2,) for r in rows)
    np.testing.assert_array_equal(rows[2], [3.0, 4.0])


def test_to_numpy_accepts_numpy_and_lists() -> None:
    rows, finite = _to_numpy(np.array([[1, 2], [3, 4]], dtype=np.float64))
    assert [r.dtype for r in rows] == [np.float32, np.float32] and finite == [True, True]
    np.testing.assert_array_equal(rows[1], [3.0, 4.0])

    arrays, finite = _to_numpy([torch.zeros(2, 3), np.full((1, 3), np.nan)])
    assert [a.shape for a in arrays] == [(2, 3), (1, 3)]
    assert [a.dtype for a in arrays] == [np.float32, np.float32]
    assert finite == [True, False]


def test_to_numpy_tensor_with_grad_and_3d() -> None:
    t = torch.ones(2, 3, 4, requires_grad=True) * 2
    rows, finite = _to_numpy(t)
    assert [r.shape for r in rows] == [(3, 4), (3, 4)] and finite == [True, True]
    assert float(rows[0][0, 0]) == 2.0
