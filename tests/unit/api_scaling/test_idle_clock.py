"""The idle clock that stops a base's replicas: a request that has just left its replica keeps the base awake."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from redis.exceptions import RedisError

from api.routing.router import ReplicaRouter
from api.scaling.scaler import ReplicaScaler

TTL_S = 4.0


class RedisDown:
    """No shared clock: idleness falls back on this process's own view."""

    async def get(self, key: str) -> Any:
        raise RedisError("down")


def scaler_for(router: ReplicaRouter) -> ReplicaScaler:
    settings = SimpleNamespace(replica_idle_ttl=TTL_S, replica_target_requests=4, replica_max=2)
    return ReplicaScaler(settings, [SimpleNamespace(name="b")], {"b": router}, RedisDown(), None, None)  # type: ignore[arg-type]


def wanted_now(scaler: ReplicaScaler) -> int:
    return scaler.wanted("b", asyncio.run(scaler.idle_for("b")))


def test_a_request_held_through_a_long_cold_start_does_not_end_with_its_replica_stopped() -> None:
    """Seen in CI: four requests held 9.8 s while a replica started were answered, and the idle check that ran
    before their final touch found the base idle for 10 s and stopped the replica that had just served them."""
    router = ReplicaRouter(registry=None)  # type: ignore[arg-type]
    scaler = scaler_for(router)
    scaler.demand["b"].touch(time.time() - 10)  # the requests arrived 10 s ago, and were held
    router.start("replica-1")
    assert wanted_now(scaler) == 1  # in flight at the replica
    router.finish("replica-1")
    assert wanted_now(scaler) == 1  # answered a moment ago: not idle, whatever the last touch says


def test_a_base_with_no_request_for_the_ttl_wants_none() -> None:
    router = ReplicaRouter(registry=None)  # type: ignore[arg-type]
    scaler = scaler_for(router)
    scaler.demand["b"].touch(time.time() - 10)
    assert wanted_now(scaler) == 0
    router.start("replica-1")
    router.finish("replica-1")
    router.last_finished -= 10  # that answer ended 10 s ago
    assert wanted_now(scaler) == 0
