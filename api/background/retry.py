"""Keeping a background consumer alive through outages of what it depends on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def keep_running(name: str, body: Callable[[], Awaitable[None]], *, max_backoff_s: float = 30.0) -> None:
    """Run ``body`` again whenever it fails (Redis down, database busy), waiting longer each time."""
    backoff = 0.5
    while True:
        try:
            await body()
            backoff = 0.5
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s failed (%s: %s); retrying in %.1fs", name, type(exc).__name__, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(max_backoff_s, backoff * 2)
