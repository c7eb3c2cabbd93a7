"""How many CPUs this process may use: its affinity, capped by its cgroup's CPU quota.

The default `--workers` comes from here, so that a job under Slurm, taskset or a container quota
starts as many decode workers as it has cores, not as many as the node has.
"""

from __future__ import annotations

import math
import os


def usable_cpus() -> int:
    """CPUs this process may use: its affinity (taskset, Slurm's binding), capped by a cgroup CPU
    quota (containers, Slurm's cgroup plugin)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, quota) if quota is not None else cpus)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> int | None:
    """The CPU quota of this process's cgroups in whole CPUs (rounded up), None when unlimited or
    unknown: the smallest cgroup v2 `cpu.max` from the process's cgroup up to the root, else the
    v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` of its cpu cgroup."""
    def read(path: str) -> str | None:
        try:
            with open(path, encoding="ascii") as f:
                return f.read().strip()
        except OSError:
            return None

    paths: dict[str, str] = {}
    for line in (read(proc) or "").splitlines():  # "0::/path" (v2), "4:cpu,cpuacct:/path" (v1)
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path.strip("/")
    quotas = []
    if "" in paths:
        parts = [p for p in paths[""].split("/") if p]
        for depth in range(len(parts), -1, -1):
            quotas.append(((read(os.path.join(root, *parts[:depth], "cpu.max")) or "max").split() + ["100000"])[:2])
    for v1 in ("cpu", "cpu,cpuacct"):
        if "cpu" in paths and os.path.isdir(os.path.join(root, v1)):
            base = os.path.join(root, v1, paths["cpu"])
            quotas.append([read(os.path.join(base, "cpu.cfs_quota_us")) or "-1",
                           read(os.path.join(base, "cpu.cfs_period_us")) or "100000"])
            break
    cpus = [math.ceil(int(q) / int(p)) for q, p in quotas if q.lstrip("-").isdigit() and p.isdigit()
            and int(q) > 0 and int(p) > 0]
    return min(cpus) if cpus else None
