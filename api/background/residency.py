"""Adapter residency reported by servers on ``RESIDENCY_STREAM``, stored as ``UsageRecord(kind="residency")``
attributed to the adapter's tenant.

Read through a consumer group (one per base model, like the training queues, so deployments sharing a
Redis do not take each other's entries), so with several API processes each entry is counted by one;
entries are acknowledged only after their rows are committed, and entries a crashed process read but
never acknowledged are claimed by another after ``CLAIM_IDLE_MS``. Increments are summed per adapter,
replica and hour before storing, so steady residency does not become a row per heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redis.exceptions import ResponseError
from sqlmodel import select
from starlette.concurrency import run_in_threadpool

from api.background.retry import keep_running
from api.context import ApiContext
from core.models import Adapter, UsageRecord
from core.protocol import RESIDENCY_STREAM

log = logging.getLogger(__name__)

GROUP_PREFIX = "loraplex-api:"
READ_COUNT = 1000
READ_BLOCK_MS = 1000
FLUSH_EVERY_S = 10.0  # under steady traffic; an idle stream flushes at once
CLAIM_IDLE_MS = 60_000
HOUR = 3600


@dataclass(frozen=True)
class ResidencyEntry:
    entry_id: bytes
    adapter_id: str
    replica: str
    page_seconds: float
    at: float


def parse_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> ResidencyEntry | None:
    """One stream entry (``adapter_id``, ``page_seconds``, ``replica``, ``at``), None when malformed."""
    try:
        text = {k.decode(): v.decode() for k, v in fields.items()}
        entry = ResidencyEntry(
            entry_id=entry_id,
            adapter_id=text["adapter_id"],
            replica=text.get("replica", ""),
            page_seconds=float(text["page_seconds"]),
            at=float(text.get("at") or time.time()),
        )
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
    return entry if entry.page_seconds >= 0 and entry.adapter_id else None


def residency_rows(entries: Iterable[ResidencyEntry], tenant_of: dict[str, str]) -> list[UsageRecord]:
    """Entries summed per (adapter, replica, hour); adapters with no known tenant are dropped."""
    sums: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for entry in entries:
        if entry.adapter_id not in tenant_of:
            continue
        total = sums[(entry.adapter_id, entry.replica, int(entry.at) // HOUR)]
        total[0] += entry.page_seconds
        total[1] = max(total[1], entry.at)
    return [
        UsageRecord(
            tenant_id=tenant_of[adapter_id],
            kind="residency",
            adapter_id=adapter_id,
            replica=replica or None,
            page_seconds=page_seconds,
            created_at=int(last_at),
        )
        for (adapter_id, replica, _hour), (page_seconds, last_at) in sorted(sums.items())
    ]


class ResidencyMeter:
    """One API process's consumer of the residency stream."""

    def __init__(self, ctx: ApiContext, *, consumer: str | None = None) -> None:
        self.ctx = ctx
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.group = GROUP_PREFIX + ctx.base_model.name
        self._tenant_of: dict[str, str] = {}

    async def run(self) -> None:
        await keep_running("residency meter", self._consume)

    async def _consume(self) -> None:
        redis = self.ctx.redis
        try:
            await redis.xgroup_create(RESIDENCY_STREAM, self.group, id="0", mkstream=True)
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

    async def _read(self, start: str, *, block: int | None = None) -> list[tuple[bytes, dict]]:
        answer = await self.ctx.redis.xreadgroup(
            self.group, self.consumer, {RESIDENCY_STREAM: start}, count=READ_COUNT, block=block
        )
        return [entry for _stream, entries in answer or () for entry in entries if entry[1] is not None]

    async def _claim_abandoned(self) -> list[tuple[bytes, dict]]:
        answer = await self.ctx.redis.xautoclaim(
            RESIDENCY_STREAM, self.group, self.consumer, min_idle_time=CLAIM_IDLE_MS, count=READ_COUNT
        )
        return [entry for entry in answer[1] if entry[1] is not None]

    async def flush(self, raw: Sequence[tuple[bytes, dict]]) -> None:
        """Store the entries' usage, then acknowledge them."""
        entries = [e for entry_id, fields in raw if (e := parse_entry(entry_id, fields)) is not None]
        if len(entries) < len(raw):
            log.warning("skipping %d malformed residency entries", len(raw) - len(entries))
        await run_in_threadpool(self._store, entries)
        await self.ctx.redis.xack(RESIDENCY_STREAM, self.group, *[entry_id for entry_id, _ in raw])

    async def _flush_quietly(self, raw: Sequence[tuple[bytes, dict]]) -> None:
        try:
            await self.flush(raw)
        except Exception:
            log.warning("could not store %d residency entries; they stay pending", len(raw), exc_info=True)

    def _store(self, entries: list[ResidencyEntry]) -> None:
        unknown = {e.adapter_id for e in entries} - self._tenant_of.keys()
        if unknown:
            with self.ctx.reading() as session:
                rows = session.exec(select(Adapter.id, Adapter.tenant_id).where(Adapter.id.in_(unknown))).all()  # type: ignore[attr-defined]
            self._tenant_of.update(dict(rows))
        rows = residency_rows(entries, self._tenant_of)
        if rows:
            with self.ctx.session() as session:
                session.add_all(rows)
