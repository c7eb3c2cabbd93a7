"""`mmenc slurm`: the sbatch script's directives, quoting (checked by running it with a stub), submission."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmenc_cli.cli import app
from mmenc_cli.config import ConfigError
from mmenc_cli.slurm import SlurmOptions, build_sbatch_script, slurm_quote, time_limit_seconds
from tests.conftest import write_jsonl

NASTY = "a b 'c' \"d\" $e `f` #g %h"


def sbatch_tokens(text: str) -> list[str]:
    """Split an #SBATCH line's rest as sbatch does (src/sbatch/opt.c `_get_argument`): quotes group,
    a backslash escapes the next character anywhere, an unquoted # starts a comment, no expansion."""
    tokens: list[str] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] == "#":
            return tokens
        arg, quote = [], ""
        while i < n and (quote or not text[i].isspace()):
            c = text[i]
            if c == "\\" and i + 1 < n:
                arg.append(text[i + 1])
                i += 2
                continue
            if quote:
                if c == quote:
                    quote = ""
                else:
                    arg.append(c)
            elif c in "'\"":
                quote = c
            elif c == "#":
                break
            else:
                arg.append(c)
            i += 1
        tokens.append("".join(arg))
        if i < n and text[i] == "#":
            return tokens


def directives(script: str) -> list[str]:
    """The #SBATCH options of a script, one token each, as sbatch reads them."""
    out = []
    for line in script.splitlines():
        if line.startswith("#SBATCH"):
            toks = sbatch_tokens(line[len("#SBATCH"):])
            assert len(toks) == 1, line
            out.append(toks[0])
        elif line and not line.startswith("#"):
            break  # sbatch stops at the first command
    return out


@pytest.fixture
def stub(tmp_path: Path) -> Path:
    """A fake python that writes its argv NUL-separated, then its pid, to $STUB_OUT."""
    path = tmp_path / "stub dir" / "python stub.sh"
    path.parent.mkdir()
    path.write_text('#!/bin/bash\nprintf \'%s\\0\' "$@" > "$STUB_OUT"\necho $$ > "$STUB_OUT.pid"\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def nasty(tmp_path: Path) -> dict[str, Path]:
    """Manifests and an output folder whose paths hold spaces, quotes, $, backticks, # and %."""
    base = tmp_path / NASTY
    base.mkdir()
    m1 = write_jsonl(base / "m 1.jsonl", [{"id": "a", "text": "t"}])
    m2 = write_jsonl(base / "it's \\ new\nline.jsonl", [{"id": "b", "text": "t"}])
    model = base / "model 'x'"
    model.mkdir()
    return {"base": base, "m1": m1, "m2": m2, "model": model, "out": base / "out \"o\" 'q'"}


def run_script(script: Path, stub_out: Path, task: int) -> tuple[list[str], int, int]:
    """Run the script with bash as Slurm would; return the stub's argv, its pid and bash's pid."""
    env = dict(os.environ, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_MIN="0", SLURM_ARRAY_TASK_COUNT="3",
               STUB_OUT=str(stub_out))
    proc = subprocess.Popen(["bash", str(script)], env=env)
    assert proc.wait(timeout=30) == 0
    argv = stub_out.read_bytes().split(b"\0")[:-1]
    return [a.decode() for a in argv], int(Path(f"{stub_out}.pid").read_text()), proc.pid


def test_script_quotes_every_argument_exactly(tmp_path: Path, stub: Path, nasty: dict[str, Path]) -> None:
    script = tmp_path / "job script.sbatch"
    extra = ["--batch-size", "8", "--text-prefix", "q: $HOME `x` 'y' \"z\"", "--keep", "a b"]
    res = CliRunner().invoke(app, ["slurm", str(nasty["m1"]), str(nasty["m2"]), "--out", str(nasty["out"]),
                                   "--model", str(nasty["model"]), "--tasks", "3", "--python", str(stub),
                                   "--script", str(script), "--", *extra])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(script)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    argv, stub_pid, bash_pid = run_script(script, tmp_path / "argv", task=2)
    assert argv == ["-m", "mmenc_cli", "encode", str(nasty["m1"]), str(nasty["m2"]), "--out", str(nasty["out"]),
                    "--model", str(nasty["model"]), "--task-count", "3", "--task-index", "2", *extra]
    assert stub_pid == bash_pid  # exec: mmenc is the batch shell, so --signal=B: reaches it directly
    text = script.read_text()
    log = f"{nasty['out']}/_mmenc/logs/%A_%a.out".replace(" %h", " %%h")
    assert f"--output={log}" in directives(text)
    assert (nasty["out"] / "_mmenc" / "logs").is_dir()  # Slurm would not create it


def test_relative_paths_become_absolute(tmp_path: Path, stub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    (tmp_path / "model").mkdir()
    res = CliRunner().invoke(app, ["slurm", "m.jsonl", "--out", "out", "--model", "model", "--tasks", "2",
                                   "--python", str(stub), "--script", "s.sbatch"])
    assert res.exit_code == 0, res.output
    argv, _, _ = run_script(tmp_path / "s.sbatch", tmp_path / "argv", task=0)
    assert argv[3:9] == [str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "out"), "--model",
                         str(tmp_path / "model"), "--task-count"]
    # a hub id is not a path: kept as given
    res = CliRunner().invoke(app, ["slurm", "m.jsonl", "--out", "out", "--model", "org/name", "--tasks", "2",
                                   "--script", "-"])
    assert "--model org/name " in res.stdout


def test_directives_for_every_option(tmp_path: Path) -> None:
    opts = SlurmOptions(manifests=("/m.jsonl",), out="/o", model="/model", tasks=4, python="/py", logs="/logs",
                        job_name="my job", partition="gpu", time="1-02:00:00", gpus_per_task=2, cpus_per_task=6,
                        mem="48G", signal_before=300, requeue=True,
                        sbatch_args=("--account=abc", "--constraint=a100|h100"), encode_args=("--batch-size", "64"))
    assert directives(build_sbatch_script(opts)) == [
        "--job-name=my job", "--array=0-3", "--ntasks=1", "--cpus-per-task=6", "--gpus-per-task=2", "--mem=48G",
        "--time=1-02:00:00", "--partition=gpu", "--requeue", "--signal=B:TERM@300", "--output=/logs/%A_%a.out",
        "--open-mode=append", "--account=abc", "--constraint=a100|h100"]
    cpu = SlurmOptions(manifests=("/m.jsonl",), out="/o", model="m", tasks=1, python="/py", logs="/l",
                       gpus_per_task=0, signal_before=0, requeue=False)
    text = build_sbatch_script(cpu)
    assert directives(text) == ["--job-name=mmenc", "--array=0-0", "--ntasks=1", "--cpus-per-task=8",
                                "--no-requeue", "--output=/l/%A_%a.out", "--open-mode=append"]
    assert text.splitlines()[-1].startswith("exec /py -m mmenc_cli encode /m.jsonl --out /o --model m ")


def test_cli_defaults(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["slurm", str(tmp_path / "m.jsonl"), "--out", str(out), "--model", "org/m",
                                   "--tasks", "5"])
    assert res.exit_code == 0, res.output
    script = Path(res.stdout.strip())
    assert script.parent == out / "_mmenc" / "slurm" and script.name.startswith("encode-")
    assert script.suffix == ".sbatch"
    assert directives(script.read_text()) == [
        "--job-name=mmenc-out", "--array=0-4", "--ntasks=1", "--cpus-per-task=8", "--gpus-per-task=1",
        "--requeue", "--signal=B:TERM@120", f"--output={out}/_mmenc/logs/%A_%a.out", "--open-mode=append"]
    assert "sbatch --array=1,3" in script.read_text()  # the re-run recipe is documented in the script
    again = CliRunner().invoke(app, ["slurm", str(tmp_path / "m.jsonl"), "--out", str(out), "--tasks", "5",
                                     "--model", "org/m"])
    assert Path(again.stdout.strip()) != script  # never overwrites an earlier script


def test_output_in_a_store_keeps_scripts_and_logs_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("s3fs")
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    res = CliRunner().invoke(app, ["slurm", "m.jsonl", "--out", "s3://bucket/runs/emb", "--model", "org/m",
                                   "--tasks", "2", "--", "--storage-option", "endpoint_url=http://h:9000"])
    assert res.exit_code == 0, res.output
    script = Path(res.stdout.strip())  # Slurm reads neither scripts nor logs from a bucket
    assert script.parent == tmp_path / "mmenc-slurm" / "bucket_runs_emb" / "slurm"
    text = script.read_text()
    assert "--job-name=mmenc-emb" in directives(text)
    assert f"--output={tmp_path}/mmenc-slurm/bucket_runs_emb/logs/%A_%a.out" in directives(text)
    assert " --out s3://bucket/runs/emb " in text and "--storage-option endpoint_url=http://h:9000" in text
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("value", ["plain", "a b", "it's", 'say "hi"', "back\\slash", "#hash", "$HOME `x`", "",
                                   "a\\\"b'c #d"])
def test_slurm_quote_round_trips(value: str) -> None:
    assert sbatch_tokens(slurm_quote(value)) == [value]


@pytest.mark.parametrize("args, message", [
    (["--", "--overwrite"], "--overwrite"),
    (["--", "--out", "x"], "--out"),
    (["--", "--task-index=1"], "--task-index"),
    (["--", "--batchsize", "3"], "No such option"),
    (["--", "--batch-size", "x"], "--batch-size"),
    (["--batch-size", "3"], "go after --"),
    (["--time", "1:00", "--signal-before", "120"], "--signal-before"),
    (["--time", "4 hours"], "--time"),
    (["--mem", "lots"], "--mem"),
    (["--logs", "/tmp/back\\slash"], "backslash"),
    (["--job-name", "two\nlines"], "line break"),
    (["--script", "-", "--submit"], "--script -"),
])
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    res = CliRunner().invoke(app, ["slurm", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "out"),
                                   "--model", "org/m", "--tasks", "2", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not (tmp_path / "out").exists()


def test_missing_manifest_exits_2(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["slurm", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"),
                                   "--model", "m", "--tasks", "2"])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_time_limits() -> None:
    assert time_limit_seconds("90") == 5400
    assert time_limit_seconds("10:30") == 630
    assert time_limit_seconds("04:00:00") == 14400
    assert time_limit_seconds("2-00") == 172800
    assert time_limit_seconds("1-02:03:04") == 93784
    assert time_limit_seconds("UNLIMITED") is None
    with pytest.raises(ConfigError):
        time_limit_seconds("4h")


def fake_sbatch(folder: Path, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / "sbatch"
    path.write_text("#!/bin/bash\nprintf '%s\\n' \"$@\" > \"$(dirname \"$0\")/args\"\n" + body)
    path.chmod(0o755)
    return folder


def submit(tmp_path: Path, path_env: str) -> object:
    write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "text": "t"}])
    return CliRunner().invoke(app, ["slurm", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "o o"),
                                    "--model", "m", "--tasks", "2", "--script", str(tmp_path / "s s.sbatch"),
                                    "--submit"], env={"PATH": path_env})


@pytest.mark.parametrize("printed", ["12345", "12345;cluster-a"])
def test_submit_prints_only_the_job_id(tmp_path: Path, printed: str) -> None:
    bindir = fake_sbatch(tmp_path / "bin", f"echo '{printed}'\n")
    res = submit(tmp_path, f"{bindir}:{os.environ['PATH']}")
    assert res.exit_code == 0, res.output
    assert res.stdout == "12345\n"
    assert (bindir / "args").read_text().splitlines() == ["--parsable", str(tmp_path / "s s.sbatch")]


def test_submit_failure_exits_3(tmp_path: Path) -> None:
    bindir = fake_sbatch(tmp_path / "bin", "echo 'sbatch: error: Invalid partition name specified' >&2\nexit 1\n")
    res = submit(tmp_path, f"{bindir}:{os.environ['PATH']}")
    assert res.exit_code == 3
    assert res.stdout == ""
    assert "Invalid partition name" in res.stderr


def test_sbatch_missing_exits_3(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    res = submit(tmp_path, str(tmp_path / "empty"))
    assert res.exit_code == 3
    assert res.stdout == ""
    assert "sbatch not found" in res.stderr and shlex.quote(str(tmp_path / "s s.sbatch")) in res.stderr
    assert (tmp_path / "s s.sbatch").is_file()  # written anyway: submit it from a login node
