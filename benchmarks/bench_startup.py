"""Start-up time of the read-only commands, and what they import.

    python benchmarks/bench_startup.py [--repeats 5]

Times `mmenc --help` (the installed console script when there is one, else `python -m
mmenc_cli`), `mmenc errors summary OUT`, `mmenc errors list OUT`, `mmenc inspect OUT` and `mmenc
status OUT` as whole processes, median of --repeats, against a bare `python -c pass` measured in
the same run; and, for each, how many modules it loads and whether torch or transformers is among
them. OUT is a small output written once with the tests' fake encoder. Target: `mmenc --help`
under 0.5 s on the 2-core CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

RUNNER = r"""
import atexit, json, sys
def _report():
    heavy = sorted({n.split(".")[0] for n in sys.modules} & {"torch", "transformers"})
    sys.stderr.write("BENCH-RESULT " + json.dumps({"heavy": heavy, "modules": len(sys.modules)}) + "\n")
atexit.register(_report)
sys.argv = ["mmenc", *sys.argv[1:]]
from mmenc_cli.cli import main
main()
"""


def build_out() -> Path:
    """A small output with embeddings and two failed items, made with the fake encoder."""
    sys.path.insert(0, str(common.REPO))
    from mmenc_cli.run.pipeline import run_encode
    from tests.conftest import make_image, write_jsonl
    from tests.fakes import FakeEncoder, factory
    from tests.runs import make_cfg

    root = common.CACHE / "work-startup"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = [{"id": f"r{i}", "image": make_image(root / f"img{i}.png", seed=i).name, "text": f"a photo {i}"}
            for i in range(20)]
    rows += [{"id": "missing", "image": "no-such-file.png"}, {"id": "blank", "text": " "}]
    manifest = write_jsonl(root / "manifest.jsonl", rows)
    run_encode(make_cfg([manifest], root / "out"), encoder_factory=factory(FakeEncoder()))
    return root / "out"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(common.machine("cpu"), flush=True)
    out = build_out()
    script = shutil.which("mmenc", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    help_cmd = [script, "--help"] if script else [common.PYTHON, "-m", "mmenc_cli", "--help"]
    cases = [("python -c pass (interpreter alone)", [common.PYTHON, "-c", "pass"], None),
             (f"{'mmenc' if script else 'python -m mmenc_cli'} --help", help_cmd, ["--help"]),
             ("mmenc errors summary OUT", None, ["errors", "summary", str(out)]),
             ("mmenc errors list OUT", None, ["errors", "list", str(out)]),
             ("mmenc inspect OUT", None, ["inspect", str(out)]),
             ("mmenc status OUT", None, ["status", str(out)])]
    print(f"median of {args.repeats} runs each (wall time of the whole process):")
    help_median = None
    for name, cmd, argv in cases:
        walls = []
        for _ in range(args.repeats):
            t = common.run_timed(cmd or [common.PYTHON, "-m", "mmenc_cli", *argv])
            walls.append(t.wall)
        # what it imports: the same arguments once more through the entry point, reporting at exit
        info = ""
        if argv is not None:
            probe = common.run_timed([common.PYTHON, "-c", RUNNER, *argv])
            r = common.parse_kv(probe)
            info = f"{r.get('modules', '?')} modules, torch/transformers imported: {', '.join(r.get('heavy', [])) or 'no'}"
            if probe.rc not in (0, 4):
                info += f" (exit code {probe.rc})"
        print(f"  {name:38s} {common.fmt_runs(walls, ' s', 3)}  {info}", flush=True)
        if argv == ["--help"]:
            help_median = common.median(walls)
    if help_median is not None:
        print(f"target `mmenc --help` < 0.5 s: {'met' if help_median < 0.5 else 'NOT met'} ({help_median:.3f} s)")
    for_contrast = common.run_timed([common.PYTHON, "-c", "import torch, transformers"])
    print(f"for contrast, `import torch, transformers` alone: {for_contrast.wall:.2f} s (once)")


if __name__ == "__main__":
    main()
