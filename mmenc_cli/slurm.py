"""Slurm array scripts for `mmenc encode`: a pure script builder and a submitter.

`build_sbatch_script(opts)` turns one `SlurmOptions` into the text of an sbatch array script with
`--array=0-(N-1)`; each array task runs `PYTHON -m mmenc_cli encode ... --task-count N
--task-index $SLURM_ARRAY_TASK_ID`. The task index and count are passed explicitly (not read from
SLURM_ARRAY_TASK_MIN/COUNT) so that re-running some tasks with `sbatch --array=1,3 SCRIPT` keeps
the same split of the input.

Quoting. The command line is quoted for bash with `shlex.quote` (any byte but NUL survives). The
`#SBATCH` lines are read by sbatch's own parser, not by a shell: it groups by single or double
quotes, treats a backslash as an escape everywhere and an unquoted `#` as a comment, and expands
nothing (`$`, backticks are literal). So those values are written in double quotes with `\\` and
`"` escaped (`slurm_quote`); a newline cannot be written at all. In `--output` Slurm also expands
`%A`, `%a`, ... (so a literal `%` is doubled), and a backslash in the name breaks it (Slurm 22.05
writes no log at all), so log folders with a backslash are refused.

Signals (the choice, and why). `--signal=B:TERM@S` sends SIGTERM S seconds before the time limit
to the batch shell only; the script `exec`s mmenc, so the batch shell *is* mmenc and gets the
signal directly. Without `B:` Slurm signals job steps started with srun but not the batch shell,
so an mmenc started from the script would never see it. On SIGTERM mmenc finishes the current
batch, commits whole shards, marks its task 'interrupted' and exits 143 (the script's exit code,
since exec leaves no shell behind). Preemption and node failure with `--requeue`: Slurm requeues
the task and the new run skips everything already in committed shards. The time limit: the task
ends 'interrupted' and is not requeued by Slurm (unless the cluster sets `RequeueExit=143`);
re-running it (`sbatch --array=<tasks> SCRIPT`, `scontrol requeue <job>_<task>` while Slurm
remembers the job, or the `mmenc status` hint) resumes. A plain `scancel` is also clean: Slurm
sends SIGTERM first and SIGKILL only after KillWait.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .clock import file_stamp
from .errors import ConfigError, SubmitError
from .output import OutDir

#: encode options that `mmenc slurm` sets itself (or that would break an array: --overwrite
#: in every task would delete the other tasks' shards)
RESERVED_ENCODE_OPTIONS = ("--out", "-o", "--model", "-m", "--task-index", "--task-count", "--overwrite")
_PLAIN = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)
_MAX_SIGNAL_TIME = 65535  # Slurm's limit for --signal=...@sig_time


@dataclass(frozen=True)
class SlurmOptions:
    """Everything the sbatch script says; paths already absolute (the CLI resolves them)."""

    manifests: tuple[str, ...]
    out: str
    model: str
    tasks: int
    python: str
    logs: str
    job_name: str = "mmenc"
    partition: str | None = None
    time: str | None = None
    gpus_per_task: int = 1
    cpus_per_task: int = 8
    mem: str | None = None
    signal_before: int = 120
    requeue: bool = True
    sbatch_args: tuple[str, ...] = ()
    encode_args: tuple[str, ...] = ()
    generated: str = ""

    def __post_init__(self) -> None:
        if not self.manifests:
            raise ConfigError("give at least one manifest")
        if self.tasks < 1:
            raise ConfigError("--tasks must be >= 1")
        if self.gpus_per_task < 0 or self.cpus_per_task < 1:
            raise ConfigError("--gpus-per-task must be >= 0 and --cpus-per-task >= 1")
        if not 0 <= self.signal_before <= _MAX_SIGNAL_TIME:
            raise ConfigError(f"--signal-before must be between 0 and {_MAX_SIGNAL_TIME} seconds")
        if self.mem is not None and not _MEM.fullmatch(self.mem):
            raise ConfigError(f"--mem {self.mem!r}: expected a size such as 32G, 500M or 16000")
        limit = time_limit_seconds(self.time) if self.time is not None else None
        if limit is not None and self.signal_before >= limit:
            raise ConfigError(f"--signal-before {self.signal_before} s is not shorter than --time {self.time}")
        if "\\" in self.logs:
            raise ConfigError(f"log folder {self.logs!r}: Slurm cannot name log files in a path with a backslash; "
                              "give another --logs")
        for what, value in (("log folder", self.logs), ("--job-name", self.job_name),
                            ("--partition", self.partition or ""), *(("--sbatch-arg", a) for a in self.sbatch_args)):
            if "\n" in value or "\r" in value:
                raise ConfigError(f"{what} {value!r}: an #SBATCH line cannot hold a line break")
        for arg in self.encode_args:
            name = arg.split("=", 1)[0]
            if name in RESERVED_ENCODE_OPTIONS:
                raise ConfigError(f"encode option {name} cannot follow --: `mmenc slurm` sets --out, --model and the "
                                  "task index/count itself; --overwrite would let tasks delete each other's shards")


def time_limit_seconds(value: str) -> int | None:
    """Seconds of a Slurm time limit (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None for unlimited."""
    text = value.strip().lower()
    if text in ("unlimited", "infinite", "-1"):
        return None
    m = _TIME.fullmatch(text)
    if not m:
        raise ConfigError(f"--time {value!r}: expected minutes, H:M:S or D-H[:M[:S]], e.g. 04:00:00")
    days, a, b, c = m.groups()
    if days is not None:
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:
        return int(a) * 3600 + int(b) * 60 + int(c)
    return int(a) * 60 + int(b or 0)


def slurm_quote(value: str) -> str:
    """Quote one value for an `#SBATCH` line (sbatch's parser: quotes group, backslash escapes)."""
    if value and _PLAIN.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _comment(value: str) -> str:
    return value.replace("\n", "\\n").replace("\r", "\\r")


def encode_command(opts: SlurmOptions) -> str:
    """The bash command line of one array task (the task index comes from Slurm at run time)."""
    argv = [opts.python, "-m", "mmenc_cli", "encode", *opts.manifests, "--out", opts.out, "--model", opts.model,
            "--task-count", str(opts.tasks)]
    index = '"${SLURM_ARRAY_TASK_ID:?not a Slurm array task: submit this script with sbatch}"'
    return " ".join([*map(shlex.quote, argv), "--task-index", index, *map(shlex.quote, opts.encode_args)])


def build_sbatch_script(opts: SlurmOptions) -> str:
    """The sbatch array script for `opts` (pure: no file system, no clock)."""
    directives = [f"--job-name={slurm_quote(opts.job_name)}", f"--array=0-{opts.tasks - 1}", "--ntasks=1",
                  f"--cpus-per-task={opts.cpus_per_task}"]
    if opts.gpus_per_task:
        directives.append(f"--gpus-per-task={opts.gpus_per_task}")
    if opts.mem:
        directives.append(f"--mem={opts.mem}")
    if opts.time:
        directives.append(f"--time={slurm_quote(opts.time)}")
    if opts.partition:
        directives.append(f"--partition={slurm_quote(opts.partition)}")
    directives.append("--requeue" if opts.requeue else "--no-requeue")
    if opts.signal_before:
        directives.append(f"--signal=B:TERM@{opts.signal_before}")
    log = opts.logs.rstrip("/").replace("%", "%%") + "/%A_%a.out"
    directives += [f"--output={slurm_quote(log)}", "--open-mode=append"]
    directives += [slurm_quote(a) for a in opts.sbatch_args]
    out, when = _comment(opts.out), f" on {opts.generated}" if opts.generated else ""
    signal = (f"{opts.signal_before} s before the time limit Slurm sends SIGTERM to this batch shell (B:), which has\n"
              "#   exec'd mmenc: mmenc finishes the batch in flight, commits whole shards and exits 143 with its task\n"
              "#   'interrupted'. (Without B: Slurm would signal only srun job steps, never this process.)"
              if opts.signal_before else "No early signal (--signal-before 0): at the time limit Slurm sends\n"
              "#   SIGTERM, then SIGKILL after KillWait; a killed task loses only its uncommitted shard.")
    requeue = ("Preemption or node failure: Slurm requeues the task (--requeue) and the new run resumes."
               if opts.requeue else "--no-requeue: a preempted task is not requeued; re-run it as below.")
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "#",
        f"# Generated by mmenc {__version__}{when}: {opts.tasks} array task(s) encode a slice each of the",
        f"# manifests into {out}",
        "# Every task resumes: re-running a task skips what its committed shards already hold.",
        f"# - {signal}",
        f"# - {requeue}",
        "# - Time limit (and any exit other than 0): Slurm does not requeue (unless slurm.conf has",
        "#   RequeueExit=143). Re-run those tasks with the same script:",
        "#     sbatch --array=1,3 THIS_SCRIPT       (the task numbers that `mmenc status OUT` lists)",
        "#   or `scontrol requeue <jobid>_<task>` while Slurm still remembers the job.",
        "# - Exit codes: 0 done, 4 error threshold exceeded, 75 task already running elsewhere, 143 SIGTERM.",
        f"# Status of every task: mmenc status {_comment(shlex.quote(opts.out))}",
        "set -u",
        f"exec {encode_command(opts)}",
        "",
    ]
    return "\n".join(lines)


def default_script_path(out: str | Path, now: float | None = None) -> Path:
    """Where a script goes by default: a new name in the output's script folder."""
    return OutDir(out).new_script_path(file_stamp(now))


def default_logs_dir(out: str | Path) -> Path:
    """Where array task logs go by default: the output's log folder."""
    return OutDir(out).logs_dir


def latest_script(out: str | Path) -> Path | None:
    """The most recently written script of the output, if any."""
    return OutDir(out).latest_script()


def write_script(path: Path, text: str) -> None:
    """Write the script (creating its folder), readable and executable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    os.chmod(path, 0o755)


def submit(script: str | Path, sbatch: str = "sbatch") -> str:
    """Submit with `sbatch --parsable SCRIPT`; return the job id. SubmitError when it cannot."""
    try:
        res = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=120)
    except FileNotFoundError:
        raise SubmitError(f"{sbatch} not found on PATH; submit the script on a Slurm login node: "
                          f"sbatch {shlex.quote(str(script))}") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SubmitError(f"{sbatch} failed: {exc}") from None
    last = (res.stderr.strip().splitlines() or [""])[-1]
    if res.returncode != 0:
        raise SubmitError(f"sbatch exited {res.returncode}: {last or 'no message'}")
    job = res.stdout.strip().split(";", 1)[0]  # --parsable: "jobid" or "jobid;cluster"
    if not job:
        raise SubmitError(f"sbatch printed no job id {last}".strip())
    return job
