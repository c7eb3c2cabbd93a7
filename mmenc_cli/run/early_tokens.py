"""Texts tokenized while the model loads.

Starting a run of a text model costs seconds of imports and loading (torch, transformers) on one
core while the others idle. Where the run reads local JSONL manifests with a model folder that has
a fast tokenizer's `tokenizer.json`, a child process (`early_child.py`: the `tokenizers` library
only, one core) tokenizes the manifests' first texts meanwhile. When the run first tokenizes, the
child is stopped and its tokens adopted, but only if its tokenizer is the loaded one (their JSON
equal, truncation and padding aside); a text's tokens are then looked up by the exact string the
encoder would tokenize, and only where the text is within the model's length (the child does not
truncate; `encoders/early_table.py`). Everything else is tokenized as always, so what is encoded never depends on the child:
a text it did not reach, skipped, or got wrong in any way is simply a miss.

Not for task slices, several devices or a custom encoder; `MMENC_EARLY_TOKENS=0` turns it off.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..encoders.early_table import EarlyTable

if TYPE_CHECKING:
    from ..config import RunConfig

log = logging.getLogger("mmenc")

CHILD = "mmenc_cli.run.early_child"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # where this mmenc_cli is imported from
#: manifest lines the child reads at most (its tokens are held for the whole run)
MAX_LINES = 131072
MANIFESTS = (".jsonl", ".ndjson")


def early_sources(cfg: "RunConfig") -> tuple[str, list[str]] | None:
    """(tokenizer.json, manifest paths) where a run may tokenize early, else None."""
    if os.environ.get("MMENC_EARLY_TOKENS", "").strip() == "0":
        return None
    if cfg.task_count != 1 or len(cfg.model.devices) != 1 or "text" not in (cfg.modalities or ("text",)):
        return None
    tokenizer = os.path.join(cfg.model.model, "tokenizer.json")
    paths = list(cfg.manifests)
    if not os.path.isfile(tokenizer) or not all(p.lower().endswith(MANIFESTS) and os.path.isfile(p) for p in paths):
        return None
    from ..cpus import usable_cpus

    return (tokenizer, paths) if usable_cpus() > 1 else None


class EarlyTokens:
    """The child tokenizing ahead, and what it sent, adopted by the encoder at its first tokenizing."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, name="mmenc-early-tokens", daemon=True)
        self.reader.start()
        self.lock = threading.Lock()
        self.sent: int | None = None  # once stopped: the frames it sent
        self.spec: dict[str, Any] | None = None  # the child's tokenizer, less truncation and padding
        self.adopted: EarlyTable | None = None  # its tokens
        self.tables: dict[str, EarlyTable | None] = {}  # by the JSON of each tokenizer that asked

    @classmethod
    def start(cls, cfg: "RunConfig") -> "EarlyTokens | None":
        """The child started for this run, or None where the run does not qualify (or it cannot start)."""
        sources = early_sources(cfg)
        if sources is None:
            return None
        tokenizer, paths = sources
        args = [sys.executable, "-m", CHILD, tokenizer, cfg.manifest.text_key or "text", cfg.model.text_prefix,
                str(MAX_LINES), *paths]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",  # one core: the one the start-up leaves
               "MMENC_EARLY_PARENT": str(os.getpid()),
               "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, env=env)
        except OSError as exc:
            log.debug("early tokenizing not started: %s", exc)
            return None
        return cls(proc)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read1(1 << 20):
            self.chunks.append(chunk)

    def close(self) -> None:
        """Stop the child (what it sent stays readable)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.reader.join()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def release(self) -> None:
        """Stop the child and drop everything it sent (the encoder needs none, or no more)."""
        with self.lock:
            self.close()
            self.chunks, self.adopted, self.spec = [], None, None
            self.tables = {key: None for key in self.tables}
            self.sent = self.sent or 0

    def _adopt(self, tokenizer_json: str, keys: Sequence[str], max_length: int) -> None:
        """Stop the child and, if its tokenizer is `tokenizer_json`'s, turn what it sent into the
        one table (a frame cut by the stop is dropped); nothing else of it is kept."""
        self.close()
        data, self.chunks = b"".join(self.chunks), []
        frames = whole_frames(data)
        del data
        self.sent = len(frames)
        if frames and isinstance(frames[0], str):
            self.spec = _spec(frames[0])
            if len(frames) > 1 and _spec(tokenizer_json) == self.spec:
                self.adopted = EarlyTable(frames[1:], keys, max_length)

    def table(self, tokenizer_json: str, keys: Sequence[str], max_length: int) -> "EarlyTable | None":
        """The tokens to look texts up in, if the child's tokenizer is `tokenizer_json` (a loaded
        fast tokenizer's backend `to_str()`); None otherwise, or when anything about what it sent
        is amiss. The child is stopped at the first call."""
        with self.lock:
            try:
                return self._table(tokenizer_json, keys, max_length)
            except Exception as exc:  # never worse than no early tokens
                log.debug("early tokens not used: %r", exc)
                self.tables[tokenizer_json] = self.adopted = None
                return None

    def _table(self, tokenizer_json: str, keys: Sequence[str], max_length: int) -> "EarlyTable | None":
        if self.sent is None:
            self._adopt(tokenizer_json, keys, max_length)
        if tokenizer_json not in self.tables:
            same = self.spec is not None and _spec(tokenizer_json) == self.spec
            self.tables[tokenizer_json] = self.adopted if same else None
            log.debug("early tokens: %s", f"{len(self.adopted.tokens)} texts tokenized while the model loaded"
                      if same and self.adopted is not None else "none used (none sent, or another tokenizer)")
        return self.tables[tokenizer_json]


def whole_frames(data: bytes) -> list[Any]:
    """The frames in `data` (each an 8-byte little-endian length and a pickle), less a last one cut short."""
    frames, at = [], 0
    while at + 8 <= len(data):
        size = int.from_bytes(data[at:at + 8], "little")
        if at + 8 + size > len(data):
            break
        frames.append(pickle.loads(data[at + 8:at + 8 + size]))
        at += 8 + size
    return frames


def _spec(tokenizer_json: str) -> dict[str, Any]:
    """A tokenizer's JSON, less the truncation and padding that calls set."""
    spec = json.loads(tokenizer_json)
    spec.pop("truncation", None)
    spec.pop("padding", None)
    return spec
