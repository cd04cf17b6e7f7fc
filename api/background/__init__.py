"""Tasks an API process runs beside its requests: adapter events (prefetch, unload), residency metering and
the replicas' audit trail, the idle watch that scales bases to zero, and usage rows waiting for the database.

Each survives Redis outages by reconnecting with a capped backoff; all stop with the app.
"""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial

from api.background.adapter_events import consume_adapter_events
from api.background.audit import AuditRecorder
from api.background.residency import ResidencyMeter
from api.context import ApiContext
from api.inference.service import insert_usage


def start_background(ctx: ApiContext) -> list[asyncio.Task[None]]:
    """Start the background consumers in the running event loop."""
    return [
        asyncio.create_task(consume_adapter_events(ctx), name="adapter-events"),
        asyncio.create_task(ResidencyMeter(ctx).run(), name="residency-meter"),
        asyncio.create_task(AuditRecorder(ctx).run(), name="audit-recorder"),
        asyncio.create_task(ctx.scaler.run(), name="replica-scaler"),
        asyncio.create_task(ctx.usage_backlog.run(partial(insert_usage, ctx)), name="usage-backlog"),
    ]


async def stop_background(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the consumers and wait for them to finish their last write."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
