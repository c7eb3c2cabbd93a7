"""The public Python API: every name `mmenc_cli` exports resolves, lazily, without torch."""

from __future__ import annotations

import subprocess
import sys


def test_every_public_name_resolves_without_importing_torch() -> None:
    code = ("import sys, mmenc_cli\n"
            "missing = [n for n in mmenc_cli.__all__ if getattr(mmenc_cli, n, None) is None]\n"
            "print(missing, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    assert out == "[] False"


def test_the_names_the_readme_shows() -> None:
    from mmenc_cli import (MMError, ModelConfig, RunConfig, RunResult, WriterConfig, iter_token_embeddings,
                           read_embeddings, read_token_embedding, run_encode)
    from mmenc_cli.run.pipeline import run_encode as the_run

    assert run_encode is the_run and callable(read_embeddings) and callable(read_token_embedding)
    assert callable(iter_token_embeddings) and RunResult.__name__ == "RunResult"
    assert issubclass(MMError, Exception) and RunConfig and ModelConfig and WriterConfig
