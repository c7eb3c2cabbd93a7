"""Fixtures of the run tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from mmenc_cli.run.decode_pool import DecodePool


@pytest.fixture
def pools() -> Iterator[list[DecodePool]]:
    """Pools a test creates are killed at teardown, even when the test fails."""
    made: list[DecodePool] = []
    yield made
    for pool in made:
        pool.close(kill=True)
