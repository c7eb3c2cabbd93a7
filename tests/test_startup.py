"""Read-only commands start instantly: they never import torch, transformers or Ray.

Each command runs in a fresh interpreter (`python -c` calling the console-script entry point),
which reports `sys.modules` at exit. The output folder they read is built in-process with the
fake encoder, with failed items so `errors` has rows to show. No wall-clock assertions here:
`benchmarks/bench_startup.py` times them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmenc_cli.run.pipeline import run_encode
from tests.conftest import make_image, write_jsonl
from tests.fakes import FakeEncoder, factory
from tests.runs import make_cfg

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "ray")
#: runs the `mmenc` entry point with argv, then reports the imported modules on stderr at exit
RUNNER = r"""
import atexit, json, sys

def _report():
    names = list(sys.modules)
    heavy = sorted({n.split(".")[0] for n in names if n.split(".")[0] in ("torch", "transformers", "ray")})
    sys.stderr.write("MMENC-MODULES " + json.dumps({"heavy": heavy, "count": len(names)}) + "\n")

atexit.register(_report)
sys.argv = ["mmenc", *sys.argv[1:]]
from mmenc_cli.cli import main
main()
"""


def run_cli(*args: str) -> tuple[int, str, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("MMENC-MODULES ")]
    assert lines, f"mmenc {' '.join(args)} did not report its modules:\n{proc.stderr[-2000:]}"
    return proc.returncode, proc.stdout, json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output with embeddings and failed items (a missing image, an empty text)."""
    root = tmp_path_factory.mktemp("startup")
    rows = []
    for i in range(8):
        rows.append({"id": f"r{i}", "image": make_image(root / f"img{i}.png", seed=i).name, "text": f"a photo {i}"})
    rows.append({"id": "missing", "image": "no-such-file.png", "text": "still encoded"})
    rows.append({"id": "blank", "text": "   "})
    manifest = write_jsonl(root / "manifest.jsonl", rows)
    out = root / "out"
    result = run_encode(make_cfg([manifest], out), encoder_factory=factory(FakeEncoder()))
    assert result.counters.failed == 2 and result.counters.balanced
    return out


def _commands() -> list[str]:
    from mmenc_cli.cli import app

    return [c.name or c.callback.__name__ for c in app.registered_commands]


@pytest.mark.parametrize("args", [
    ("--help",),
    ("ray", "--help"),
    ("errors", "summary", "{out}"),
    ("errors", "list", "{out}"),
    ("errors", "list", "{out}", "--json"),
    ("inspect", "{out}"),
    ("inspect", "{out}", "--json"),
    ("status", "{out}"),
], ids=lambda a: " ".join(a).replace("{out}", "OUT"))
def test_read_only_commands_do_not_import_torch_transformers_or_ray(out: Path, args: tuple[str, ...]) -> None:
    if args[0] == "status" and "status" not in _commands():
        pytest.skip("this build has no `mmenc status` command")
    argv = [a.replace("{out}", str(out)) for a in args]
    rc, stdout, modules = run_cli(*argv)
    allowed = {"status": (0, 4)}.get(args[0], (0,))  # status: 4 = some task needs attention
    assert rc in allowed, f"mmenc {' '.join(argv)} exited {rc}"
    assert stdout.strip(), f"mmenc {' '.join(argv)} printed nothing on stdout"
    assert modules["heavy"] == [], f"mmenc {' '.join(argv)} imported {modules['heavy']}"
    if args[:2] == ("errors", "list"):
        assert "missing" in stdout and "blank" in stdout


def test_the_check_itself_sees_torch_when_it_is_imported(out: Path) -> None:
    """The probe is not blind: the same runner with torch imported first reports it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = RUNNER.replace("from mmenc_cli.cli import main", "import torch\nfrom mmenc_cli.cli import main")
    proc = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("MMENC-MODULES "))
    assert json.loads(line.split(" ", 1)[1])["heavy"] == ["torch"]
