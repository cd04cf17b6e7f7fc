"""The live replicas, read from the heartbeats servers keep in Redis (``core.protocol.replica_key``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from core.errors import ServiceUnavailable
from core.protocol import REPLICA_KEY_PREFIX, REPLICA_TTL_S, ReplicaStatus

log = logging.getLogger(__name__)

REDIS_RETRY_AFTER_S = 5.0


class ReplicaRegistry:
    """Reads heartbeats at most once per ``cache_s``: a SCAN per request would be wasted work, and the
    heartbeats themselves are only refreshed every couple of seconds."""

    def __init__(
        self,
        redis: Redis,
        base_model: str,
        *,
        cache_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.base_model = base_model
        self.cache_s = cache_s
        self.clock = clock
        self._cached: list[ReplicaStatus] = []
        self._read_at = float("-inf")
        self._refresh = asyncio.Lock()

    async def live(self) -> list[ReplicaStatus]:
        """Replicas serving our base model whose heartbeat has not expired; ``ServiceUnavailable`` if Redis is down."""
        if self.clock() - self._read_at < self.cache_s:
            return self._cached
        async with self._refresh:  # one reader refreshes; the requests that queued behind it reuse its answer
            if self.clock() - self._read_at >= self.cache_s:
                self._cached = await self.read()
                self._read_at = self.clock()
        return self._cached

    def forget_cached(self) -> None:
        """The next ``live`` reads Redis again (a replica was just started or stopped)."""
        self._read_at = float("-inf")

    async def read(self) -> list[ReplicaStatus]:
        """Every live replica of our base model, straight from Redis."""
        try:
            keys = [key async for key in self.redis.scan_iter(match=REPLICA_KEY_PREFIX + "*", count=1000)]
            values = await self.redis.mget(keys) if keys else []
        except (RedisError, OSError) as exc:
            raise ServiceUnavailable(
                "the replica registry (Redis) is unreachable; retry shortly",
                retry_after=REDIS_RETRY_AFTER_S,
                code="redis_unavailable",
            ) from exc
        replicas = []
        stale_before = time.time() - REPLICA_TTL_S
        for key, value in zip(keys, values, strict=True):
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                status = ReplicaStatus.model_validate_json(value)
            except ValidationError:
                log.warning("ignoring a malformed heartbeat at %s", key)
                continue
            # A server that stopped without its key expiring (no TTL set) must not attract requests.
            if status.base_model == self.base_model and status.updated_at >= stale_before:
                replicas.append(status)
        return sorted(replicas, key=lambda r: r.id)
