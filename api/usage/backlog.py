"""Usage rows the database could not take when their request ended, stored again until it can.

A request's usage is written as it ends (``api.inference.service.finish_request``). If the database is away
at that moment (a PostgreSQL restart, a failover), the row used to be logged and lost while the client had
its answer. It now waits here and is written once the database answers, by the background task this module
runs, oldest first, a batch per transaction. The wait is bounded (``MAX_ROWS``): past it the oldest rows are
dropped, and the loss is logged with their token counts. Rows wait in this process's memory: an API process
that dies while the database is away loses what it held.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from core.models import UsageRecord

log = logging.getLogger(__name__)

MAX_ROWS = 100_000
RETRY_EVERY_S = 2.0
BATCH = 500


class UsageBacklog:
    """Rows waiting for the database, as plain values (a failed session leaves its objects unusable)."""

    def __init__(self, max_rows: int = MAX_ROWS) -> None:
        self._rows: deque[dict[str, Any]] = deque()
        self._max = max_rows

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, row: UsageRecord) -> None:
        self._rows.append(row.model_dump(exclude={"id"}))
        while len(self._rows) > self._max:
            lost = self._rows.popleft()
            log.error(
                "dropped the usage of request %s (tenant %s, %d+%d tokens): the database was away too long",
                lost.get("request_id"),
                lost.get("tenant_id"),
                lost.get("prompt_tokens", 0),
                lost.get("completion_tokens", 0),
            )

    async def run(self, insert: Callable[[list[UsageRecord]], None]) -> None:
        """Write waiting rows with ``insert`` (one transaction per batch) for the life of the app."""
        while True:
            await asyncio.sleep(RETRY_EVERY_S)
            await self.flush(insert)

    async def flush(self, insert: Callable[[list[UsageRecord]], None]) -> int:
        """Write what waits, batch by batch, until done or the database refuses; how many rows were written."""
        written = 0
        while self._rows:
            batch = [self._rows[i] for i in range(min(BATCH, len(self._rows)))]
            try:
                await run_in_threadpool(insert, [UsageRecord(**values) for values in batch])
            except Exception as exc:
                log.warning("%d usage rows still wait for the database: %s", len(self._rows), exc)
                return written
            for _ in batch:
                self._rows.popleft()
            written += len(batch)
        if written:
            log.info("stored %d usage rows that had waited for the database", written)
        return written
