"""Tell inference servers about a new adapter so they can prefetch it (best effort: they load on demand anyway)."""

from __future__ import annotations

import json
import logging

import redis

from core.models import Adapter
from core.queue import ADAPTER_EVENTS_CHANNEL, redis_url
from core.settings import Settings

log = logging.getLogger(__name__)


def announce_prefetch(settings: Settings, adapter: Adapter) -> bool:
    """Publish ``{"event": "prefetch", "adapter": descriptor}`` on the adapter events channel; False on failure."""
    message = json.dumps({"event": "prefetch", "adapter": adapter.descriptor().model_dump(mode="json")})
    try:
        client = redis.Redis.from_url(redis_url(settings), socket_timeout=2, socket_connect_timeout=2)
        with client:
            client.publish(ADAPTER_EVENTS_CHANNEL, message)
    except Exception:
        log.warning("could not announce adapter %s for prefetch", adapter.id, exc_info=True)
        return False
    return True
