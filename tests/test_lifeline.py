"""`lifeline`: under an engine, a process started by the encode process dies with it. A parent that
asked for it (`require`) and is SIGKILLed takes its child along at once; one that did not leaves its
child running (the control: the check can tell the two apart)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

CHILD = "import time; from mmenc_cli.lifeline import inherit; print(inherit(), flush=True); time.sleep(600)"
PARENT = f"""
import subprocess, sys, time
from mmenc_cli import lifeline
if sys.argv[1] == "require":
    lifeline.require()
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def kill_parent(mode: str) -> tuple[psutil.Process, str]:
    """Start the parent (which starts its child), SIGKILL the parent; the child and what its
    `inherit()` said."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MMENC_DIE_WITH_PARENT", None)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None
    pid, said = parent.stdout.readline().split()
    child = psutil.Process(int(pid))
    parent.send_signal(signal.SIGKILL)
    parent.wait(30)
    return child, said


def test_a_child_dies_with_a_parent_that_asked_for_it() -> None:
    child, said = kill_parent("require")
    assert said == "True"
    child.wait(timeout=30)  # raises TimeoutExpired when it lives on
    assert not child.is_running()


def test_without_the_request_a_child_lives_on() -> None:
    child, said = kill_parent("plain")
    try:
        assert said == "False"
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    finally:
        child.kill()


POOL = """
import ctypes, multiprocessing as mp, os, sys
from concurrent.futures import ProcessPoolExecutor

def armed(_):
    sig = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    return sig.value

if __name__ == "__main__":
    from mmenc_cli import lifeline
    from mmenc_cli.config import MediaConfig
    from mmenc_cli.run.decode_pool import start_forkserver
    from mmenc_cli.run.decode_worker import Preprocessors, init_worker
    if sys.argv[1] == "require":
        lifeline.require()
    start_forkserver(torch=False)
    with ProcessPoolExecutor(2, mp_context=mp.get_context("forkserver"), initializer=init_worker,
                             initargs=(Preprocessors(), MediaConfig(), os.getpid(), None, None)) as ex:
        print(sorted(set(ex.map(armed, range(8)))))
"""


@pytest.mark.parametrize("mode,signals", [("require", "[9]"), ("plain", "[0]")])
def test_decode_workers_are_tied_to_their_forkserver_only_when_asked(tmp_path: Path, mode: str, signals: str) -> None:
    script = tmp_path / "pool.py"
    script.write_text(POOL)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MMENC_DIE_WITH_PARENT", None)
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == signals  # SIGKILL when the forkserver (tied to the encode process) dies
