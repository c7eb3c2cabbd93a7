"""mmenc: batch encoder for offline multimodal embedding precomputation.

The core is importable without the CLI and without torch:

    from mmenc_cli import read_embeddings, run_encode, RunConfig
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "read_embeddings": ("output.embeddings", "read_embeddings"),
    "inspect_output": ("output.inspect", "inspect_output"),
    "read_token_embedding": ("output.embeddings", "read_token_embedding"),
    "iter_token_embeddings": ("output.embeddings", "iter_token_embeddings"),
    "run_encode": ("run.pipeline", "run_encode"),
    "RunResult": ("run.counters", "RunResult"),
    "RunConfig": ("config", "RunConfig"),
    "ModelConfig": ("config", "ModelConfig"),
    "WriterConfig": ("config", "WriterConfig"),
    "ManifestConfig": ("config", "ManifestConfig"),
    "MediaConfig": ("config", "MediaConfig"),
    "BatchConfig": ("config", "BatchConfig"),
    "MMError": ("errors", "MMError"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import public names on first use so `import mmenc_cli` stays cheap."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(name)
