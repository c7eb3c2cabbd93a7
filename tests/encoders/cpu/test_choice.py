"""`PathChoice`: the run's own batches, timed, choose between oneDNN's and PyTorch's CPU linears.

Driven with synthetic timings (seconds per unit of input for each path), as the encoder drives
it: `begin()` says the path of the next batch, `end(seconds, units)` records it.
"""

from __future__ import annotations

import pytest

from mmenc_cli.encoders.cpu import choice as cpu_choice
from mmenc_cli.encoders.cpu.choice import PathChoice


def drive(choice: PathChoice, n: int, per_unit, units=lambda i: 1000) -> list[bool]:
    """Run n batches; per_unit(i, on) is batch i's seconds per unit on that path. Returns the paths."""
    paths = []
    for i in range(n):
        on = choice.begin()
        paths.append(on)
        choice.end(per_unit(i, on) * units(i), units(i))
    return paths


def bound_on_other_path(n: int) -> int:
    """Most batches on the path not chosen: the warm-ups and the first two timed batches (on the
    reference path, before any score), the early probes, then one per PERIOD."""
    return cpu_choice.WARMUP + 2 + cpu_choice.EARLY_PROBES + n // cpu_choice.PERIOD


def test_a_faster_alternative_is_chosen_and_the_slower_path_runs_rarely() -> None:
    choice = PathChoice("fast")
    paths = drive(choice, 300, lambda i, on: 0.8 if on else 1.0)
    assert paths[:cpu_choice.WARMUP] == [False] * cpu_choice.WARMUP  # warm-up batches: the reference path
    assert choice.choice is True and choice.on in (True, False)
    assert paths.count(False) <= bound_on_other_path(300)
    assert abs(__import__("statistics").median(choice.scores) - 0.8) < 1e-9
    assert "0.80x" in choice.summary()


@pytest.mark.parametrize("ratio", [1.25, 1.01])  # slower, and a tie within the margin: PyTorch's path
def test_a_slower_or_equal_alternative_is_not_chosen(ratio: float) -> None:
    choice = PathChoice("alt")
    paths = drive(choice, 300, lambda i, on: ratio if on else 1.0)
    assert choice.choice is False
    assert 0 < paths.count(True) <= bound_on_other_path(300)
    assert "PyTorch's own path" in choice.summary()


def test_growing_batch_shapes_are_compared_with_both_neighbours() -> None:
    """Texts come sorted by length: each batch is costlier per unit than the last. A probe is
    scored against the mean of the batches before and after it, so two equal paths tie."""
    choice = PathChoice("alt")
    drive(choice, 200, lambda i, on: 1.0 + 0.05 * i)
    assert choice.choice is False
    assert all(abs(s - 1.0) < 0.01 for s in choice.scores), list(choice.scores)


def test_the_choice_follows_a_change_during_the_run() -> None:
    """The alternative is slower for the first 150 batches, then faster (e.g. longer texts)."""
    choice = PathChoice("alt")
    drive(choice, 150, lambda i, on: 1.3 if on else 1.0)
    assert choice.choice is False
    drive(choice, 400, lambda i, on: 0.7 if on else 1.0)
    assert choice.choice is True


def test_untimed_and_failed_batches_do_not_shift_the_scores() -> None:
    """A batch begun but never ended (it failed, or ran untimed on all threads) is not recorded;
    the next batch takes its slot. The warm-up batches are never timed."""
    choice = PathChoice("alt")
    seen = []
    for i in range(60):
        on = choice.begin()
        if i % 5 == 4:
            continue  # failed: no end()
        seen.append(on)
        choice.end(0.9 if on else 1.0, 1)
    assert sum(choice.counts) == len(seen) - cpu_choice.WARMUP  # all but the warm-up
    assert choice.choice is True and all(abs(s - 0.9) < 1e-9 for s in choice.scores)
    choice.end(0.0, 0)  # nothing measured: ignored
    assert sum(choice.counts) == len(seen) - cpu_choice.WARMUP


@pytest.mark.parametrize("fixed", [True, False])
def test_a_pinned_path_is_never_probed(fixed: bool) -> None:
    choice = PathChoice("alt", fixed=fixed)
    assert set(drive(choice, 50, lambda i, on: 0.5 if on != fixed else 1.0)) == {fixed}
    assert not choice.scores and sum(choice.counts) == 0 and "fixed" in choice.summary()


def probe_indices(paths: list[bool], choice_path: bool) -> list[int]:
    """The timed-batch indices (from 0) that ran on the path not chosen, after the warm-ups."""
    return [i - cpu_choice.WARMUP for i, on in enumerate(paths) if i >= cpu_choice.WARMUP and on != choice_path]


def test_a_clear_winner_widens_the_gap_between_probes_up_to_max_period() -> None:
    """oneDNN's linears at 0.75x PyTorch's time (as on a Zen 4): after the early probes the gap
    doubles at each probe that agrees, 32, 64, then MAX_PERIOD, so over 1000 batches far
    fewer run on the slower path than one in PERIOD would give."""
    choice = PathChoice("fast")
    n = 1000
    paths = drive(choice, n, lambda i, on: 0.75 if on else 1.0)
    assert choice.choice is True and choice.period == cpu_choice.MAX_PERIOD
    probes = [i for i in probe_indices(paths, True) if i >= 2 * cpu_choice.EARLY_PROBES - 1]
    assert probes[0] == 2 * cpu_choice.EARLY_PROBES - 1  # the last early probe, the first paced one
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [32, 64, 128, 128], probes
    assert all(g == cpu_choice.MAX_PERIOD for g in gaps[3:])
    old_bound = cpu_choice.EARLY_PROBES + (n - 2 * cpu_choice.EARLY_PROBES) // cpu_choice.PERIOD
    assert paths.count(False) < old_bound / 3, (paths.count(False), old_bound)


def test_a_close_call_keeps_probing_every_period() -> None:
    """oneDNN's linears 5% slower (within DECISIVE): the gap stays PERIOD, the choice stays
    PyTorch's path, and the probes keep coming at the steady pace."""
    choice = PathChoice("alt")
    paths = drive(choice, 400, lambda i, on: 1.05 if on else 1.0)
    assert choice.choice is False and choice.period == cpu_choice.PERIOD
    probes = [i for i in probe_indices(paths, False) if i >= 2 * cpu_choice.EARLY_PROBES]
    assert {b - a for a, b in zip(probes, probes[1:])} == {cpu_choice.PERIOD}


def test_a_widened_gap_falls_back_when_a_probe_disagrees_and_the_choice_still_follows() -> None:
    """Clearly slower alternative for 600 batches (gap at MAX_PERIOD), then clearly faster: the
    first probe that finds it faster resets the gap to PERIOD, and the choice flips within a
    few periods after that rather than waiting MAX_PERIOD per probe."""
    choice = PathChoice("alt")
    drive(choice, 600, lambda i, on: 1.3 if on else 1.0)
    assert choice.choice is False and choice.period == cpu_choice.MAX_PERIOD
    paths = drive(choice, 600, lambda i, on: 0.7 if on else 1.0)
    assert choice.choice is True
    first_on_run = next(i for i in range(len(paths) - 2) if paths[i] and paths[i + 1] and paths[i + 2])
    # at most MAX_PERIOD to the first probe, then KEEP // 2 + 1 probes a PERIOD apart, plus slack
    assert first_on_run <= cpu_choice.MAX_PERIOD + (cpu_choice.KEEP // 2 + 1) * cpu_choice.PERIOD + 4, first_on_run
