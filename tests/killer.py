"""Run the mmenc CLI with a SIGKILL injected at one exact point (test-only wrapper, no product hook).

KILL_AT (environment) chooses where the process kills itself:
  mid_batch:N     inside the N-th encoder forward call (a batch is half done)
  before_rename:N after the N-th shard's temp file is written and fsynced, before its rename
  after_rename:N  right after the N-th shard's rename
  end             after everything is committed, before the task metadata says "done"
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mmenc_cli import outdir  # noqa: E402
from mmenc_cli.run import pipeline  # noqa: E402

where, _, n = os.environ.get("KILL_AT", "").partition(":")
count = {"n": 0}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def nth() -> bool:
    count["n"] += 1
    return count["n"] == int(n or 1)


if where in ("before_rename", "after_rename"):
    real_commit = outdir.OutDir.commit

    def commit(self, tmp, name):  # type: ignore[no-untyped-def]
        hit = nth()
        if hit and where == "before_rename":
            die()
        path = real_commit(self, tmp, name)
        if hit:
            die()
        return path

    outdir.OutDir.commit = commit  # type: ignore[method-assign]
elif where == "mid_batch":
    real_load = pipeline.EncodeRun.load_encoder

    def load(self):  # type: ignore[no-untyped-def]
        if self.encoder is not None:
            return self.encoder
        enc = real_load(self)
        real_encode = enc.encode

        def encode(modality, payloads):  # type: ignore[no-untyped-def]
            if nth():
                die()
            return real_encode(modality, payloads)

        enc.encode = encode
        return enc

    pipeline.EncodeRun.load_encoder = load  # type: ignore[method-assign]
elif where == "end":
    real_meta = pipeline.write_task_meta

    def meta(out, cfg, state, *a, **k):  # type: ignore[no-untyped-def]
        if state == "done":
            die()
        return real_meta(out, cfg, state, *a, **k)

    pipeline.write_task_meta = meta

if __name__ == "__main__":
    from mmenc_cli.cli import main

    sys.argv[0] = "mmenc"
    main()
