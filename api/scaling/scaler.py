"""Holding requests while a base's replica starts, and stopping replicas of bases idle past the TTL.

A request for a base with no live replica is held (at most ``LORAPLEX_REPLICA_HOLD_MAX`` per base, each for at
most ``LORAPLEX_REPLICA_START_TIMEOUT_S``) while one launch, shared by every held request, asks the launcher
for a replica and waits for its heartbeat. If the launch fails (the launcher refused, or the replica died
before registering) every held request gets a 503 saying why at once; past the deadline, a 503 too; never a
hang. The time from the first held request to the replica's heartbeat is the cold start, logged and observed
in ``loraplex_api_cold_start_seconds``.

Idleness is shared between API processes through Redis (:func:`activity_key`, written at most once a second
per process): a base is idle once no process has started or finished one of its requests for the TTL and this
process has none in flight or held. Then its replicas are stopped; KEDA's view of the same signal is
``loraplex_api_replicas_wanted`` (``api.metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from api.base_model import BaseModelInfo, BaseModels
from api.metrics import ApiMetrics
from api.routing.router import ReplicaRouter
from api.scaling.demand import BaseDemand, replicas_wanted
from api.scaling.launchers import Launcher, LaunchFailed
from core.errors import ServiceUnavailable
from core.protocol import HEARTBEAT_S
from core.settings import Settings

log = logging.getLogger(__name__)

ACTIVITY_PREFIX = "loraplex:base-active:"
SHARE_EVERY_S = 1.0
POLL_S = 0.25  # how often a launch looks for the new replica's heartbeat
RETRY_AFTER_S = 5.0


def activity_key(base: str) -> str:
    """Redis key holding the last time any API process started or finished a request for ``base``."""
    return ACTIVITY_PREFIX + base


class ReplicaScaler:
    """One API process's view of each base's demand, its cold starts, and its idle watch."""

    def __init__(
        self,
        settings: Settings,
        bases: BaseModels,
        routers: dict[str, ReplicaRouter],
        redis: Redis,
        launcher: Launcher | None,
        metrics: ApiMetrics,
    ) -> None:
        self.settings = settings
        self.bases = bases
        self.routers = routers
        self.redis = redis
        self.launcher = launcher
        self.metrics = metrics
        self.demand = {base.name: BaseDemand() for base in bases}
        self._launches: dict[str, asyncio.Task[None]] = {}
        self._shared_at: dict[str, float] = {}

    # ----- requests ------------------------------------------------------------------------------------------

    async def ready(self, base: BaseModelInfo) -> None:
        """Return once ``base`` has a live replica: at once if it has one or nothing can start one (the
        router then answers as before), else after holding the request through a launch."""
        router = self.routers[base.name]
        if self.launcher is None or await router.registry.live():
            return
        demand = self.demand[base.name]
        if demand.held >= self.settings.replica_hold_max:
            raise ServiceUnavailable(
                f"{demand.held} requests already wait for a replica of {base.name!r} to start; retry shortly",
                retry_after=RETRY_AFTER_S,
                code="replica_starting",
            )
        demand.held += 1
        try:
            launch = self._launches.get(base.name)
            if launch is None:
                launch = self._launches[base.name] = asyncio.create_task(self._launch(base))
                launch.add_done_callback(lambda task: self._launched(base.name, task))
            timeout = self.settings.replica_start_timeout_s
            try:
                await asyncio.wait_for(asyncio.shield(launch), timeout)
            except TimeoutError:
                raise ServiceUnavailable(
                    f"no replica of {base.name!r} started within {timeout:.0f} s; retry shortly",
                    retry_after=RETRY_AFTER_S,
                    code="replica_start_timeout",
                ) from None
        finally:
            demand.held -= 1

    async def touch(self, base: str) -> None:
        """A request for ``base`` started or finished: the base is not idle."""
        now = time.time()
        self.demand[base].touch(now)
        if now - self._shared_at.get(base, 0.0) < SHARE_EVERY_S:
            return
        self._shared_at[base] = now
        ttl = self.settings.replica_idle_ttl
        with contextlib.suppress(RedisError, OSError):  # idleness then falls back on this process's view
            await self.redis.set(activity_key(base), f"{now:.3f}", ex=int(2 * ttl) + 60 if ttl else 3600)

    def delivered(self, base: str, tokens: int) -> None:
        self.demand[base].tokens.add(tokens)

    # ----- cold starts ---------------------------------------------------------------------------------------

    def _launched(self, base: str, task: asyncio.Task[None]) -> None:
        self._launches.pop(base, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: every waiter may have timed out before it ended

    async def _launch(self, base: BaseModelInfo) -> None:
        assert self.launcher is not None
        started = time.monotonic()
        registry = self.routers[base.name].registry
        log.info("cold start of %s: no live replica; asking the %s launcher for one", base.name, self.launcher.kind)
        try:
            await run_in_threadpool(self.launcher.start, base)
            while not await registry.read():
                reason = self.launcher.failure(base)
                if reason is not None:
                    raise LaunchFailed(reason)
                if time.monotonic() - started > self.settings.replica_start_timeout_s:
                    raise LaunchFailed(f"it did not register within {self.settings.replica_start_timeout_s:.0f} s")
                await asyncio.sleep(POLL_S)
        except LaunchFailed as exc:
            self.metrics.cold_starts.labels(base.name, "failed").inc()
            log.error("cold start of %s failed: %s", base.name, exc)
            raise ServiceUnavailable(
                f"a replica of {base.name!r} could not be started: {exc}",
                retry_after=RETRY_AFTER_S,
                code="replica_start_failed",
            ) from exc
        registry.forget_cached()
        seconds = time.monotonic() - started
        self.metrics.cold_starts.labels(base.name, "started").inc()
        self.metrics.cold_start_seconds.labels(base.name).observe(seconds)
        log.info("cold start of %s: a replica registered after %.1f s", base.name, seconds)

    # ----- idleness ------------------------------------------------------------------------------------------

    async def idle_for(self, base: str) -> float:
        """Seconds since any API process last started or finished a request for ``base``. A request that just
        left its replica counts at once: one held through a long cold start last touched the clock when it
        arrived, and an idle check between its answer and its final touch would stop the replica it woke."""
        last = max(self.demand[base].last_active, self.routers[base].last_finished)
        with contextlib.suppress(RedisError, OSError, ValueError, TypeError):
            shared = await self.redis.get(activity_key(base))
            if shared is not None:
                last = max(last, float(shared))
        return max(0.0, time.time() - last)

    def busy(self, base: str) -> tuple[int, int]:
        """Requests of ``base`` this process has in flight at replicas, and holds for a start."""
        return sum(self.routers[base].in_flight.values()), self.demand[base].held

    def wanted(self, base: str, idle_s: float) -> int:
        """The replica count ``base``'s load asks for, idle ``idle_s`` seconds (``idle_for``, read once by the
        caller, which reports it too): ``api.scaling.demand.replicas_wanted``."""
        in_flight, held = self.busy(base)
        settings = self.settings
        return replicas_wanted(
            in_flight,
            held,
            idle_s,
            idle_ttl=settings.replica_idle_ttl,
            target_requests=settings.replica_target_requests,
            most=settings.replica_max,
        )

    async def run(self) -> None:
        """Stop the replicas of bases idle past the TTL, for the life of the app."""
        ttl = self.settings.replica_idle_ttl
        if ttl is None or self.launcher is None:
            return
        tick = max(0.2, min(ttl / 4, HEARTBEAT_S))
        while True:
            await asyncio.sleep(tick)
            for base in self.bases:
                try:
                    await self._settle(base, ttl)
                except Exception:  # one base's trouble (Redis, the cluster) must not end the watch
                    log.warning("idle check of %s failed", base.name, exc_info=True)

    async def _settle(self, base: BaseModelInfo, ttl: float) -> None:
        assert self.launcher is not None
        if base.name in self._launches:
            return
        idle = await self.idle_for(base.name)
        if self.wanted(base.name, idle) > 0 or await run_in_threadpool(self.launcher.replicas, base) == 0:
            return
        log.info("%s idle for %.0f s (ttl %.0f s): stopping its replicas", base.name, idle, ttl)
        await run_in_threadpool(self.launcher.stop, base)
        self.routers[base.name].registry.forget_cached()
        self.metrics.scale_downs.labels(base.name).inc()

    async def close(self) -> None:
        for task in list(self._launches.values()):
            task.cancel()
        if self.launcher is not None:
            await run_in_threadpool(self.launcher.close)
