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

from mmenc_cli.output.outdir import OutDir  # noqa: E402
from mmenc_cli.output.task import TaskOutput  # noqa: E402
from mmenc_cli.run import pipeline  # noqa: E402

where, _, n = os.environ.get("KILL_AT", "").partition(":")
count = {"n": 0}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def nth() -> bool:
    count["n"] += 1
    return count["n"] == int(n or 1)


if where in ("before_rename", "after_rename"):
    real_publish = OutDir.publish_shard

    def publish_shard(self, name, content):  # type: ignore[no-untyped-def]
        hit = nth()
        if hit and where == "before_rename":
            self.fs.stage(self.tmp_path(name), content)  # written and fsynced, never renamed
            die()
        path = real_publish(self, name, content)
        if hit:
            die()
        return path

    OutDir.publish_shard = publish_shard  # type: ignore[method-assign]
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
    real_close = TaskOutput.close

    def close(self, record, best_effort=False):  # type: ignore[no-untyped-def]
        if record is not None and record.get("state") == "done":
            die()
        return real_close(self, record, best_effort)

    TaskOutput.close = close  # type: ignore[method-assign]

if __name__ == "__main__":
    from mmenc_cli.cli import main

    sys.argv[0] = "mmenc"
    main()
