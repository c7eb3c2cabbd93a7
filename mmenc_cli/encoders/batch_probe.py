"""The default batch size on CUDA, chosen per model by a short probe of forwards at load.

A batch size that is right for a small model starves a GPU, and one that is right for a small
model runs a large one out of memory; so without `--batch-size`, a CUDA run times the model's own
forward on dummy inputs at a few sizes, smallest first, and takes the largest that

* fits: no out-of-memory error, and a peak of at most `MEMORY_SHARE` of the device's memory (the
  rest is for the next batch's copy, `--decode gpu`'s images, and inputs larger than the dummy);
* does not lose throughput: items/s at least `KEEP_RATE` of the best smaller size's.

It stops at the first size that fails either test, or once it has taken `BUDGET_S`. Each size is
timed over `REPEATS` forwards after one warm-up, between device synchronizations. The probe is the
model's work only (no decode, no copy back), so it says what the device can take, not what the
host can feed: the pipeline keeps several batches in flight either way. The CPU keeps its fixed
default (`config.DEFAULT_BATCH_SIZE`): larger batches do not speed a CPU forward up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import DeviceError, first_line, is_device_fault, is_out_of_memory

log = logging.getLogger("mmenc")

#: the sizes tried, smallest first
SIZES = (32, 64, 128, 256, 512)
#: a larger size is kept only when its rate is at least this share of the best smaller size's
KEEP_RATE = 0.95
#: the most of the device's memory a probe forward's peak may take
MEMORY_SHARE = 0.6
#: timed forwards per size, after one warm-up
REPEATS = 2
#: no larger size is tried once the probe has taken this long (seconds)
BUDGET_S = 15.0


@dataclass
class ProbeResult:
    """What the probe chose, and each size it tried: items/s, peak bytes, and why it stopped there."""

    chosen: int
    tried: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """For the task metadata (`forward.batch_probe`)."""
        return {"chosen": self.chosen, "tried": self.tried, "sizes": list(SIZES), "keep_rate": KEEP_RATE,
                "memory_share": MEMORY_SHARE}


@dataclass
class Device:
    """What the probe needs of the device: wait for it, reset and read its peak memory, its total
    memory, and free its cached memory after an out-of-memory error."""

    sync: Callable[[], None]
    reset_peak: Callable[[], None]
    peak: Callable[[], int]
    total: int
    free_cache: Callable[[], None]


def cuda_device(device: str) -> Device:
    """`Device` for a CUDA device through torch.cuda."""
    import torch

    dev = torch.device(device)
    return Device(sync=lambda: torch.cuda.synchronize(dev), reset_peak=lambda: torch.cuda.reset_peak_memory_stats(dev),
                  peak=lambda: int(torch.cuda.max_memory_allocated(dev)),
                  total=int(torch.cuda.get_device_properties(dev).total_memory), free_cache=torch.cuda.empty_cache)


def probe_batch_size(run: Callable[[int], Any], device: Device, clock: Callable[[], float] | None = None,
                     sizes: tuple[int, ...] = SIZES) -> ProbeResult:
    """The largest of `sizes` whose forward (`run(n)`: one forward of n dummy items) fits and does
    not lose throughput (see the module docstring); the smallest when none fits. `clock`:
    `time.perf_counter`, looked up at the call."""
    clock = clock or time.perf_counter
    result = ProbeResult(sizes[0])
    best, start = 0.0, clock()
    for size in sizes:
        entry: dict[str, Any] = {"size": size}
        result.tried.append(entry)
        device.reset_peak()
        failure = _timed(run, size, device, clock, entry)
        if failure is not None:  # outside the `except`: the failed forward's tensors are freed first
            device.free_cache()
            entry["stopped"] = failure
            break
        entry["peak_bytes"] = peak = device.peak()
        if peak > MEMORY_SHARE * device.total:
            entry["stopped"] = f"peak over {MEMORY_SHARE:.0%} of the device's memory"
            break
        if entry["items_per_s"] < KEEP_RATE * best:
            entry["stopped"] = f"under {KEEP_RATE:.0%} of a smaller size's rate"
            break
        result.chosen, best = size, max(best, entry["items_per_s"])
        if clock() - start > BUDGET_S:
            entry["stopped"] = f"the probe's {BUDGET_S:g} s are spent"
            break
    device.reset_peak()  # the run's own peak is what the metadata reports
    log.info("batch size %d for this model on this device (probe: %s)", result.chosen,
             ", ".join(f"{e['size']}: {e.get('items_per_s', 0):.0f}/s" for e in result.tried))
    return result


def _timed(run: Callable[[int], Any], size: int, device: Device, clock: Callable[[], float],
           entry: dict[str, Any]) -> str | None:
    """Time `REPEATS` forwards of `size` after a warm-up into `entry`; why it failed, or None. A
    sticky device error raises `DeviceError`."""
    try:
        run(size)
        device.sync()
        t0 = clock()
        for _ in range(REPEATS):
            run(size)
        device.sync()
        entry["items_per_s"] = round(REPEATS * size / max(clock() - t0, 1e-9), 1)
        return None
    except Exception as exc:
        if is_device_fault(exc):
            raise DeviceError.of(exc, " while probing batch sizes") from None
        if is_out_of_memory(exc):
            return "out of memory"
        return f"failed: {type(exc).__name__}: {first_line(exc)}"
