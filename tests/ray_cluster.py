"""The Ray cluster the `mmenc ray` tests run on.

`.ci/run` starts a real head on loopback (`ray start --head --num-cpus 2`) whose environment holds
the local S3 server's test credentials (its workers read them as a node reads its own chain) and
exports MMENC_TEST_RAY=HOST:PORT. Without it, every driver a test starts brings up a local Ray of
its own (`--address local`), whose workers inherit the driver's environment. This is a plain
module, not a conftest::

    from tests.ray_cluster import ray_address, ray_env, require_ray

`require_ray()` skips a test where Ray is not installed, and fails it under CI=true, where `.ci/run`
installs it (as `tests/slurm_cluster.require_slurm`). `python -m tests.ray_cluster ENDPOINT` prints
the variables `.ci/run` gives the head (the S3 server's credentials, as the tests' fixtures use).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests.s3server import store_env

#: Ray's own switch that keeps a cluster on loopback (else it binds the machine's first interface)
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def require_ray() -> None:
    """Skip the calling test when Ray is not installed; fail it under CI=true."""
    if importlib.util.find_spec("ray") is not None:
        return
    msg = "Ray is not installed (pip install 'mmenc[ray]')"
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def ray_address() -> str:
    """The head `.ci/run` started, else `local` (each driver starts its own)."""
    return os.environ.get("MMENC_TEST_RAY") or "local"


def ray_env() -> dict[str, str]:
    """What a driver's environment needs here: loopback only; against `.ci/run`'s head, its
    token (Ray enables token authentication for a cluster started with `ray start`, and a driver
    given an explicit address reads the token only with RAY_AUTH_MODE=token)."""
    return {**LOOPBACK, **({"RAY_AUTH_MODE": "token"} if os.environ.get("MMENC_TEST_RAY") else {})}


if __name__ == "__main__":
    print("\n".join(f"{k}={v}" for k, v in {**LOOPBACK, **store_env(sys.argv[1])}.items()))
