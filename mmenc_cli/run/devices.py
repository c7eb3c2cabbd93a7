"""One process per device (`--device cuda:0,cuda:1`): each encodes its share of the task's slice.

The parent opens the task (its lock and its record: role "devices"); each device worker is a
spawned process running an `EncodeRun` with `primary=False`, whose task opens under a lock of its
own (task, worker: role "device"), so a re-run's worker waits for a dying orphan instead of
writing beside it. Rows are shared out by id
hash (`EncodeRun._rows`), so each worker's duplicate check sees all rows of an id. A signal to the
parent is forwarded to the workers; a worker whose parent dies stops at once. A worker's
`RunError` reaches the parent with its exit code, which the parent's run then ends with.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from ..config import RunConfig
from ..errors import RunError
from ..lifeline import inherit
from ..output.task import TaskRequest, open_task
from ..readers import preflight
from .counters import Counters, RunResult, threshold_exceeded
from .metadata import task_record


def device_worker(run_cls: Any, cfg: RunConfig, worker: int, worker_count: int, results: Any, parent: int) -> None:
    """Entry point of one device's process: encode its share of the task's slice."""
    import signal

    inherit(parent)  # under an engine that kills the encode process, no orphan goes on committing
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def watch_parent() -> None:  # the parent was SIGKILLed: commit whole shards and exit, never outlive it
        while not stop.wait(0.5):
            if os.getppid() != parent:
                stop.set()

    threading.Thread(target=watch_parent, daemon=True).start()
    try:  # its task opens under a lock of its own: a re-run's worker waits for a dying orphan
        res = run_cls(cfg, worker=worker, worker_count=worker_count, stop=stop, primary=False).run()
        results.put((worker, res, None))
    except BaseException as exc:  # reported to the parent, which fails the run with the same exit code
        code = exc.exit_code if isinstance(exc, RunError) else 1
        results.put((worker, None, (type(exc).__name__, str(exc), code)))


def run_devices(cfg: RunConfig, run_cls: Any, progress: Callable[[Counters], None] | None,
                stop: threading.Event) -> RunResult:
    """Run `run_cls` (an `EncodeRun`) in one process per device, under the task's lock held here."""
    t_start = time.perf_counter()
    preflight(cfg.manifests, cfg.manifest)  # the inputs, before anything is written (each worker looks again)
    output = open_task(TaskRequest(root=cfg.writer.out, task=cfg.task_index, role="devices", overwrite=cfg.overwrite,
                                   wait_lock=cfg.wait_lock, meta=lambda: task_record(cfg, "running", Counters(), 0.0),
                                   storage_options=cfg.writer.store_options, single_writer=cfg.writer.single_writer))
    try:
        got, errors = _spawn_and_wait(cfg, run_cls, stop)
        if errors:
            codes = {code for _, _, code in errors}
            raise RunError("; ".join(msg for _, msg, _ in errors), exit_code=codes.pop() if len(codes) == 1 else 1)
        result = _merge(cfg, output.root, got, t_start)
    except BaseException:
        output.close(None, best_effort=True)
        raise
    output.close(task_record(cfg, result.state, result.counters, result.elapsed, result))
    if progress:
        progress(result.counters)
    return result


def _spawn_and_wait(cfg: RunConfig, run_cls: Any, stop: threading.Event) -> tuple[dict[int, Any], list[tuple[str, str, int]]]:
    """Start the workers, forward a stop signal to them, and gather (worker -> result, errors)."""
    import multiprocessing as mp
    import signal

    devices = cfg.model.devices
    child_cfg = replace(cfg, overwrite=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=device_worker, args=(run_cls, child_cfg, w, len(devices), results, os.getpid()),
                         daemon=False) for w in range(len(devices))]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    errors: list[tuple[str, str, int]] = []
    forwarded = False
    while len(got) < len(procs):
        if stop.is_set() and not forwarded:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
            forwarded = True
        try:
            w, res, err = results.get(timeout=0.5)
        except queue.Empty:
            _reap_dead(procs, got, errors, results, devices, stop)
            continue
        got[w] = res
        if err:
            errors.append((err[0], f"device worker {w} ({devices[w]}): {err[0]}: {err[1]}", err[2]))
    for p in procs:
        p.join()
    return got, errors


def _reap_dead(procs: list[Any], got: dict[int, Any], errors: list[tuple[str, str, int]], results: Any,
               devices: tuple[str, ...], stop: threading.Event) -> None:
    """Workers that died without reporting count as finished; unless stopping, as failed."""
    dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in got]
    if not dead or not results.empty():
        return
    time.sleep(0.5)
    if not results.empty():
        return
    for i in dead:
        got[i] = None
        if not stop.is_set():  # else killed by the stop signal before its handler was installed
            errors.append(("RuntimeError", f"device worker {i} ({devices[i]}) died with exit code {procs[i].exitcode}", 1))


def _merge(cfg: RunConfig, root: str, got: dict[int, Any], t_start: float) -> RunResult:
    """One result from the workers' results."""
    counters = Counters()
    facts: dict[str, Any] = {}
    states, events = [], []
    for res in got.values():
        if res is None:  # stopped before it started: nothing written
            states.append("interrupted")
            continue
        counters.merge(res.counters)
        facts = facts or res.facts
        states.append(res.state)
        events += res.events
    state = "interrupted" if "interrupted" in states else ("stopped" if "stopped" in states else "done")
    loaded = [r for r in got.values() if r is not None and r.model_loaded]
    return RunResult(out=root, task=cfg.task_index, state=state, counters=counters, facts=facts,
                     elapsed=time.perf_counter() - t_start, threshold_exceeded=threshold_exceeded(cfg, counters),
                     model_loaded=bool(loaded), events=events, forward=loaded[0].forward if loaded else None,
                     batch_size=loaded[0].batch_size if loaded else None)
