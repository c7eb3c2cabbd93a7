"""Kubernetes Indexed Jobs without a wrapper: the task index from JOB_COMPLETION_INDEX, the count from
MMENC_TASK_COUNT (or --task-count); an index without a count, or a count without an index, is a usage
error (exit 2). Three "pods" (processes that differ only by JOB_COMPLETION_INDEX) writing into one
bucket equal one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmenc_cli.cli.encode import task_from_env
from mmenc_cli.errors import ConfigError
from mmenc_cli.output.embeddings import read_embeddings
from tests.s3server import bucket, s3_server, store_env  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
TASK_VARS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT", "JOB_COMPLETION_INDEX",
             "MMENC_TASK_COUNT")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No task variable of any engine in the environment."""
    for name in TASK_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_index_of_an_indexed_job_and_its_count(clean_env: pytest.MonkeyPatch) -> None:
    assert task_from_env(None, None) == (0, 1)
    clean_env.setenv("JOB_COMPLETION_INDEX", "2")
    clean_env.setenv("MMENC_TASK_COUNT", "5")
    assert task_from_env(None, None) == (2, 5)
    assert task_from_env(None, 7) == (2, 7)  # --task-count wins over MMENC_TASK_COUNT
    assert task_from_env(4, None) == (4, 5)  # --task-index wins over JOB_COMPLETION_INDEX
    clean_env.delenv("MMENC_TASK_COUNT")
    assert task_from_env(None, 3) == (2, 3)


def test_slurm_variables_win_over_the_indexed_job_s(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in (("JOB_COMPLETION_INDEX", "0"), ("MMENC_TASK_COUNT", "9"), ("SLURM_ARRAY_TASK_ID", "12"),
                        ("SLURM_ARRAY_TASK_MIN", "10"), ("SLURM_ARRAY_TASK_COUNT", "4")):
        clean_env.setenv(name, value)
    assert task_from_env(None, None) == (2, 4)


@pytest.mark.parametrize("env,words", [
    ({"JOB_COMPLETION_INDEX": "1"}, ("JOB_COMPLETION_INDEX=1", "MMENC_TASK_COUNT", "--task-count")),
    ({"MMENC_TASK_COUNT": "3"}, ("MMENC_TASK_COUNT=3", "no task index")),
    ({"JOB_COMPLETION_INDEX": "one", "MMENC_TASK_COUNT": "3"}, ("JOB_COMPLETION_INDEX='one'", "whole number")),
    ({"JOB_COMPLETION_INDEX": "0", "MMENC_TASK_COUNT": "three"}, ("MMENC_TASK_COUNT='three'", "whole number")),
], ids=["index-without-count", "count-without-index", "index-not-a-number", "count-not-a-number"])
def test_an_incomplete_or_malformed_task_environment_is_refused(clean_env: pytest.MonkeyPatch, env: dict[str, str],
                                                               words: tuple[str, ...]) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        task_from_env(None, None)
    assert all(w in str(err.value) for w in words), str(err.value)


def texts(path: Path, n: int) -> Path:
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"t{i}", "text": "" if i % 97 == 96 else f"text number {i}"}) + "\n")
    return path


def encode(manifest: Path, out: str, env: dict[str, str], *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "mmenc_cli", "encode", str(manifest), "--out", out, "--modality", "text",
            "--shard-size", "40", "--progress", "none", "--workers", "0", *extra]
    clean = {k: v for k, v in os.environ.items() if k not in TASK_VARS}
    return subprocess.Popen(args, env={**clean, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def vectors(out: str) -> dict[str, np.ndarray]:
    ids, matrix = read_embeddings(out, "text")
    assert len(ids) == len(set(ids)), "an id committed twice"
    return dict(zip(ids, matrix))


def test_an_index_without_a_count_is_exit_2_before_anything_is_written(tmp_path: Path) -> None:
    manifest = texts(tmp_path / "m.jsonl", 10)
    code, err = finished(encode(manifest, str(tmp_path / "out"), {"JOB_COMPLETION_INDEX": "1"}))
    assert code == 2 and "MMENC_TASK_COUNT" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_three_indexed_pods_equal_one_run(tmp_path: Path, bucket: str, s3_server: str) -> None:
    manifest = texts(tmp_path / "m.jsonl", 900)
    out = f"s3://{bucket}/emb"
    pods = [encode(manifest, out, {**store_env(s3_server), "JOB_COMPLETION_INDEX": str(i), "MMENC_TASK_COUNT": "3"})
            for i in range(3)]
    results = [finished(p) for p in pods]
    assert [code for code, _ in results] == [0, 0, 0], results
    assert finished(encode(manifest, str(tmp_path / "one"), {}))[0] == 0
    got, want = vectors(out), vectors(str(tmp_path / "one"))
    assert got.keys() == want.keys() and len(want) == 891
    for key in want:  # batches of other texts pad differently: equal up to float noise
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=0)
    status = status_of(out, s3_server)
    assert status["all_done"] and status["task_count"] == 3 and status["duplicates"]["count"] == 0
    assert sum(t["errors"] for t in status["tasks"]) == 9 and all(t["encoded"] for t in status["tasks"])


def status_of(out: str, endpoint: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "mmenc_cli", "status", out, "--json"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **store_env(endpoint)}, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def documented_job(tmp_path: Path) -> dict[str, Any]:
    """The Indexed Job of docs/cloud.md, as `kubectl apply` would receive it from the documented
    commands (run by bash, with `kubectl` and `mmenc` standing in)."""
    import re

    import yaml

    text = (ROOT / "docs" / "cloud.md").read_text().split("## Kubernetes Indexed Jobs", 1)[1]
    script = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "kind: Job" in b)
    stubs = f'kubectl() {{ cat > {tmp_path / "job.yaml"}; }}\nmmenc() {{ :; }}\n'
    subprocess.run(["bash", "-euc", stubs + script], check=True, timeout=30)
    return yaml.safe_load((tmp_path / "job.yaml").read_text())


def test_the_documented_indexed_job_is_consistent(tmp_path: Path) -> None:
    job = documented_job(tmp_path)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    assert int(env["MMENC_TASK_COUNT"]) == spec["completions"]  # one value
    assert container["command"][:2] == ["mmenc", "encode"] and "--task-index" not in container["command"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 60
    rules = spec["podFailurePolicy"]["rules"]
    by_action = {r["action"]: r["onExitCodes"]["values"] for r in rules if "onExitCodes" in r}
    assert by_action == {"FailIndex": [2, 3, 4], "Count": [75, 137, 143]}
    assert spec["backoffLimitPerIndex"] >= 1  # what FailIndex needs
    for rule in rules:
        codes = rule.get("onExitCodes")
        if codes:
            assert codes["containerName"] == container["name"] and codes["operator"] == "In"
            assert codes["values"] == sorted(set(codes["values"])) and 0 not in codes["values"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
