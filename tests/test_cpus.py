"""Default `--workers`: the CPUs the process may use (affinity, cgroup quota), less one per device."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmenc_cli import cpus
from mmenc_cli.config import BatchConfig


def cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "proc").write_text(proc)
    return str(root), str(tmp_path / "proc")


def test_cgroup_v2_quota_smallest_on_the_path(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, "0::/slurm/job_7/step_0\n", {
        "cpu.max": "max 100000\n", "slurm/cpu.max": "800000 100000\n",
        "slurm/job_7/cpu.max": "350000 100000\n", "slurm/job_7/step_0/cpu.max": "max 100000\n"})
    assert cpus.cgroup_cpu_quota(root, proc) == 4  # 3.5 CPUs, rounded up


def test_cgroup_v2_unlimited(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cpus.cgroup_cpu_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root, proc = cgroup(tmp_path, "4:cpu,cpuacct:/docker/abc\n1:memory:/docker/abc\n", {
        "cpu/docker/abc/cpu.cfs_quota_us": "200000\n", "cpu/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cpus.cgroup_cpu_quota(root, proc) == 2
    root, proc = cgroup(tmp_path / "u", "4:cpu,cpuacct:/\n", {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cpus.cgroup_cpu_quota(root, proc) is None


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cpus.cgroup_cpu_quota(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_usable_cpus_is_affinity_capped_by_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 6)
    assert cpus.usable_cpus() == 6
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: None)
    assert cpus.usable_cpus() == 16


@pytest.mark.parametrize("usable, workers, devices, expected", [
    (16, None, 1, 15),   # all but one, no cap at 8
    (64, None, 1, 63),
    (16, None, 2, 7),    # (16 - 2) split between two device processes
    (2, None, 1, 1),
    (1, None, 1, 1),     # never fewer than one worker
    (16, 6, 2, 3),       # --workers is the total, split between devices
    (16, 0, 2, 0),       # --workers 0: decode in each device process
])
def test_workers_per_device(monkeypatch: pytest.MonkeyPatch, usable: int, workers: int | None, devices: int,
                            expected: int) -> None:
    monkeypatch.setattr("mmenc_cli.config.usable_cpus", lambda: usable)
    assert BatchConfig(workers=workers).workers_per_device(devices) == expected
