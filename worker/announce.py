"""Tell inference servers about adapters: a new one they may prefetch, a retired one they should unload (best
effort both ways: they load on demand, and evict idle adapters, anyway)."""

from __future__ import annotations

import json
import logging

import redis

from core.models import Adapter
from core.queue import ADAPTER_EVENTS_CHANNEL, redis_url
from core.settings import Settings

log = logging.getLogger(__name__)


def announce_prefetch(settings: Settings, adapter: Adapter) -> bool:
    """Publish ``{"event": "prefetch", "adapter": descriptor, "cause": "job:<id>"}`` on the adapter events
    channel; False on failure."""
    return _announce(settings, "prefetch", [adapter])


def announce_unload(settings: Settings, adapters: list[Adapter]) -> bool:
    """Publish an ``unload`` event per adapter (retired checkpoints); False on failure."""
    return _announce(settings, "unload", adapters)


def _announce(settings: Settings, event: str, adapters: list[Adapter]) -> bool:
    if not adapters:
        return True
    try:
        client = redis.Redis.from_url(redis_url(settings), socket_timeout=2, socket_connect_timeout=2)
        with client:
            for adapter in adapters:
                cause = f"job:{adapter.job_id}" if adapter.job_id else None
                message = {"event": event, "adapter": adapter.descriptor().model_dump(mode="json"), "cause": cause}
                client.publish(ADAPTER_EVENTS_CHANNEL, json.dumps(message))
    except Exception:
        log.warning("could not announce %s of %s", event, ", ".join(a.id for a in adapters), exc_info=True)
        return False
    return True
