"""Replicas' audit events (``AUDIT_STREAM``) stored as ``AuditEvent`` rows, attributed to the adapter's tenant.

Read through a consumer group (``api.background.streams``), so with several API processes each event is
stored once. Events of local adapters (a server's own ``--adapter-root``) have no tenant.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from api.background.streams import RawEntry, StreamConsumer
from core.audit import event_rows
from core.protocol import AUDIT_STREAM, AdapterAuditEvent

log = logging.getLogger(__name__)


def parse_event(fields: dict[bytes, bytes]) -> AdapterAuditEvent | None:
    """One stream entry's event (field ``event``: JSON), None when malformed."""
    try:
        return AdapterAuditEvent.model_validate_json(fields[b"event"])
    except (KeyError, ValidationError):
        return None


class AuditRecorder(StreamConsumer):
    """One API process's consumer of the audit stream."""

    stream = AUDIT_STREAM
    what = "audit"

    async def store(self, raw: Sequence[RawEntry]) -> None:
        events = [e for _, fields in raw if (e := parse_event(fields)) is not None]
        if len(events) < len(raw):
            log.warning("skipping %d malformed audit entries", len(raw) - len(events))
        await run_in_threadpool(self._store, events)

    def _store(self, events: list[AdapterAuditEvent]) -> None:
        rows = event_rows(events, self.owners({e.adapter_id for e in events if e.adapter_id}))
        if rows:
            with self.ctx.session() as session:
                session.add_all(rows)
