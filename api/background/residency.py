"""Adapter residency reported by servers on ``RESIDENCY_STREAM``, stored as ``UsageRecord(kind="residency")``
attributed to the adapter's tenant.

Read through a consumer group (``api.background.streams``), so with several API processes each entry is
counted once. Increments are summed per adapter, replica and hour before storing, so steady residency does
not become a row per heartbeat.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from api.background.streams import RawEntry, StreamConsumer
from core.models import UsageRecord
from core.protocol import RESIDENCY_STREAM

log = logging.getLogger(__name__)

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


class ResidencyMeter(StreamConsumer):
    """One API process's consumer of the residency stream."""

    stream = RESIDENCY_STREAM
    what = "residency"

    async def store(self, raw: Sequence[RawEntry]) -> None:
        entries = [e for entry_id, fields in raw if (e := parse_entry(entry_id, fields)) is not None]
        if len(entries) < len(raw):
            log.warning("skipping %d malformed residency entries", len(raw) - len(entries))
        await run_in_threadpool(self._store, entries)

    def _store(self, entries: list[ResidencyEntry]) -> None:
        rows = residency_rows(entries, self.owners({e.adapter_id for e in entries}))
        if rows:
            with self.ctx.session() as session:
                session.add_all(rows)
