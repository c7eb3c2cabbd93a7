"""Run by `early_tokens.py` (imports only `tokenizers`, numpy and `lifeline`): tokenize the texts of
JSONL manifests on a spare core while the parent process imports torch and loads its model.

    python -m mmenc_cli.run.early_child TOKENIZER_JSON TEXT_KEY PREFIX MAX_LINES PATH...

Writes frames to stdout, each an 8-byte little-endian length and a pickle: first the tokenizer's
JSON as loaded here (no truncation, no padding), then one frame per chunk of texts: the texts
(PREFIX + the record's TEXT_KEY string) and their tokens, without truncation. Lines that are not
a JSON object with a non-blank string at TEXT_KEY, and texts over `MAX_CHARS`, are passed over:
the parent tokenizes whatever it finds no tokens for. Dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from itertools import chain
from typing import Any, Iterator

import numpy as np
from tokenizers import Tokenizer

from ..lifeline import die_with_parent

CHUNK = 2048  # texts per frame (and per tokenizer call)
MAX_CHARS = 4096  # longer texts are the parent's to cut and tokenize
MAX_TOTAL_CHARS = 1 << 25  # characters sent at most (what the parent holds until it adopts them)


def texts(paths: list[str], key: str, prefix: str, max_lines: int) -> Iterator[str]:
    """The texts of the manifests' first `max_lines` lines, in order, up to `MAX_TOTAL_CHARS`."""
    lines = chars = 0
    for path in paths:
        with open(path, "rb") as fh:
            for line in fh:
                lines += 1
                if lines > max_lines:
                    return
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                text = record.get(key) if type(record) is dict else None
                if type(text) is str and text.strip() and len(text) <= MAX_CHARS and _utf8(text):
                    chars += len(text)
                    if chars > MAX_TOTAL_CHARS:
                        return
                    yield prefix + text


def _utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the parent reports it
        return False
    return True


def frame(obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.write(len(data).to_bytes(8, "little") + data)
    sys.stdout.buffer.flush()


def tokens(encode: Any, chunk: list[str]) -> dict[str, Any]:
    """The chunk's texts and their token ids and type ids, flat, with each text's start."""
    encodings = encode(chunk)
    ids = [e.ids for e in encodings]
    starts = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(i) for i in ids], out=starts[1:])
    total = int(starts[-1])
    return {"texts": chunk, "starts": starts,
            "input_ids": np.fromiter(chain.from_iterable(ids), np.int32, total),
            "token_type_ids": np.fromiter(chain.from_iterable(e.type_ids for e in encodings), np.int32, total)}


def main(argv: list[str]) -> None:
    die_with_parent(int(os.environ.get("MMENC_EARLY_PARENT") or os.getppid()))
    tokenizer_json, key, prefix, max_lines, *paths = argv
    tokenizer = Tokenizer.from_file(tokenizer_json)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    frame(tokenizer.to_str())
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    chunk: list[str] = []
    for text in texts(paths, key, prefix, int(max_lines)):
        chunk.append(text)
        if len(chunk) == CHUNK:
            frame(tokens(encode, chunk))
            chunk = []
    if chunk:
        frame(tokens(encode, chunk))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (BrokenPipeError, KeyboardInterrupt):
        os._exit(0)
