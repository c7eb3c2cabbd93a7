"""MMError, the reason table, classify; the run-level errors and their exit codes."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from mmenc_cli.errors import (REASONS, ConfigError, ExitCode, LockBusy, ManifestError, MMError, ModelLoadError,
                              OutputError, RunError, SubmitError, classify, trim_message)

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_table_lists_every_reason_with_its_code() -> None:
    text = (ROOT / "docs" / "errors-and-resume.md").read_text()
    rows = dict((r, int(c)) for c, r in re.findall(r"^\| (\d{3}) \| `([a-z0-9_.]+)` \|", text, re.M))
    assert rows == {k: v[0] for k, v in REASONS.items()}


def test_mmerror_defaults_code_from_reason_and_pickles() -> None:
    e = MMError("gone", stage="load", reason="media.not_found", error="FileNotFoundError")
    assert e.code == 404
    back = pickle.loads(pickle.dumps(e))
    assert (back.code, back.stage, back.reason, back.error, back.message) == (404, "load", "media.not_found",
                                                                               "FileNotFoundError", "gone")
    with pytest.raises(ValueError):
        MMError("x", reason="no.such.reason")
    with pytest.raises(ValueError):
        MMError("x", stage="nowhere")


@pytest.mark.parametrize("exc,reason,code", [
    (FileNotFoundError("x"), "media.not_found", 404),
    (PermissionError("x"), "media.permission_denied", 403),
    (IsADirectoryError("x"), "media.is_directory", 400),
    (RuntimeError("CUDA out of memory. Tried to allocate"), "encode.out_of_memory", 507),
    (ValueError("boom"), "encode.failed", 500),
    (TimeoutError("slow"), "remote.timeout", 504),
])
def test_classify(exc: Exception, reason: str, code: int) -> None:
    e = classify(exc, "encode")
    assert (e.reason, e.code, e.error) == (reason, code, type(exc).__name__)


def test_trim_message_one_line_and_bounded() -> None:
    assert trim_message("a\n b\tc") == "a b c"
    assert len(trim_message("x" * 10_000)) == 500


@pytest.mark.parametrize("cls, code", [(ConfigError, 2), (OutputError, 3), (ModelLoadError, 3), (ManifestError, 3),
                                       (SubmitError, 3), (LockBusy, 75), (RunError, 1)])
def test_run_errors_carry_their_exit_code_across_processes(cls: type, code: int) -> None:
    err = cls("it broke")
    assert isinstance(err, RunError) and err.exit_code == code
    back = pickle.loads(pickle.dumps(err))  # device workers send theirs to the parent
    assert type(back) is cls and str(back) == "it broke" and back.exit_code == code
    assert RunError("x", exit_code=ExitCode.SETUP).exit_code == 3
    assert isinstance(ConfigError("x"), ValueError) and isinstance(ManifestError("x"), ValueError)
