"""Reading a Redis stream that servers append to, each entry stored once however many API processes read it.

A consumer group per stream and base model (deployments sharing a Redis do not take each other's entries):
entries are acknowledged only after what they become is committed, and entries a crashed process read but
never acknowledged are claimed by another after ``CLAIM_IDLE_MS``. Entries are stored in batches: at once
when the stream is idle, at least every ``FLUSH_EVERY_S`` under steady traffic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence

from redis.exceptions import ResponseError
from sqlmodel import col, select

from api.background.retry import keep_running
from api.context import ApiContext
from core.models import Adapter

log = logging.getLogger(__name__)

GROUP_PREFIX = "loraplex-api:"
READ_COUNT = 1000
READ_BLOCK_MS = 1000
FLUSH_EVERY_S = 10.0  # under steady traffic; an idle stream flushes at once
CLAIM_IDLE_MS = 60_000

RawEntry = tuple[bytes, dict]


class StreamConsumer:
    """One API process's consumer of ``stream``; subclasses say how a batch of entries is stored."""

    stream: str
    what: str  # for logs: "residency", "audit"

    def __init__(self, ctx: ApiContext, *, consumer: str | None = None) -> None:
        self.ctx = ctx
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.group = GROUP_PREFIX + ctx.base_model.name
        self._tenant_of: dict[str, str] = {}  # adapter id -> owning tenant: it never changes, so it is kept

    def owners(self, adapter_ids: set[str]) -> dict[str, str]:
        """The owning tenant of every adapter known so far, asking the database only for new ids (deleted
        adapters included; ids of no adapter are simply absent). Blocking: call it from a worker thread."""
        unknown = adapter_ids - self._tenant_of.keys()
        if unknown:
            with self.ctx.reading() as session:
                rows = session.exec(select(Adapter.id, Adapter.tenant_id).where(col(Adapter.id).in_(unknown))).all()
            self._tenant_of.update(dict(rows))
        return self._tenant_of

    async def store(self, raw: Sequence[RawEntry]) -> None:
        """Commit what ``raw`` entries say (malformed ones are skipped, with a warning)."""
        raise NotImplementedError

    async def run(self) -> None:
        await keep_running(f"{self.what} consumer", self._consume)

    async def _consume(self) -> None:
        redis = self.ctx.redis
        try:
            await redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        held = await self._read("0")  # what this consumer read before a reconnect but did not acknowledge
        held += await self._claim_abandoned()
        flushed_at = time.monotonic()
        try:
            while True:
                fresh = await self._read(">", block=READ_BLOCK_MS)
                held += fresh
                due = not fresh or len(held) >= READ_COUNT or time.monotonic() - flushed_at >= FLUSH_EVERY_S
                if held and due:
                    await self.flush(held)
                    held, flushed_at = [], time.monotonic()
        finally:
            if held:  # stopping: store what was read; if that fails it stays pending for the next reader
                await asyncio.shield(self._flush_quietly(held))

    async def _read(self, start: str, *, block: int | None = None) -> list[RawEntry]:
        answer = await self.ctx.redis.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=READ_COUNT, block=block
        )
        return [entry for _stream, entries in answer or () for entry in entries if entry[1] is not None]

    async def _claim_abandoned(self) -> list[RawEntry]:
        answer = await self.ctx.redis.xautoclaim(
            self.stream, self.group, self.consumer, min_idle_time=CLAIM_IDLE_MS, count=READ_COUNT
        )
        return [entry for entry in answer[1] if entry[1] is not None]

    async def flush(self, raw: Sequence[RawEntry]) -> None:
        """Store the entries, then acknowledge them."""
        await self.store(raw)
        await self.ctx.redis.xack(self.stream, self.group, *[entry_id for entry_id, _ in raw])

    async def _flush_quietly(self, raw: Sequence[RawEntry]) -> None:
        try:
            await self.flush(raw)
        except Exception:
            log.warning("could not store %d %s entries; they stay pending", len(raw), self.what, exc_info=True)
