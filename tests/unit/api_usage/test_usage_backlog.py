"""Usage rows wait for the database in order, within a bound, and leave only once stored."""

from __future__ import annotations

import asyncio
import logging

import pytest

from api.usage.backlog import UsageBacklog
from core.models import UsageRecord


def row(n: int) -> UsageRecord:
    return UsageRecord(tenant_id="tenant-1", kind="inference", request_id=f"req-{n}", completion_tokens=n)


def test_rows_wait_until_the_database_takes_them_in_order(caplog: pytest.LogCaptureFixture) -> None:
    backlog = UsageBacklog(max_rows=3)
    for n in range(4):
        backlog.add(row(n))
    assert "dropped the usage of request req-0" in caplog.text and len(backlog) == 3
    stored: list[list[str | None]] = []
    database_up = False

    def insert(rows: list[UsageRecord]) -> None:
        if not database_up:
            raise ConnectionError("connection refused")
        stored.append([r.request_id for r in rows])

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(backlog.flush(insert)) == 0
    assert len(backlog) == 3 and "3 usage rows still wait" in caplog.text
    database_up = True
    assert asyncio.run(backlog.flush(insert)) == 3
    assert stored == [["req-1", "req-2", "req-3"]] and len(backlog) == 0
