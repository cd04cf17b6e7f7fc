"""Everything a request handler reaches: settings, database, object store, job queue, base models.

Built once per app by :func:`build_context` (nothing at module level) and reached through the
dependencies in ``api/deps.py``. Inference adds an async Redis client (rate limits, replica registry,
background consumers), a replica router per base model and the HTTP client to the inference servers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import redis
import redis.asyncio
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel

from api.base_model import BaseModelInfo, BaseModels, load_base_models
from api.inference.upstream import Upstream
from api.job_queue import JobQueue
from api.metrics import ApiMetrics
from api.rate_limits import RateLimiter
from api.routing.registry import ReplicaRegistry
from api.routing.router import ReplicaRouter
from api.scaling.launchers import make_launcher
from api.scaling.scaler import ReplicaScaler
from api.usage.backlog import UsageBacklog
from core.db import make_engine, read_session, session_scope
from core.descriptor import AdapterDescriptor
from core.queue import ADAPTER_EVENTS_CHANNEL, make_celery, redis_url
from core.settings import Settings
from core.storage import ObjectStore, open_store

log = logging.getLogger(__name__)


@dataclass
class ApiContext:
    """The long-lived resources of one API process."""

    settings: Settings
    engine: Engine
    store: ObjectStore
    jobs: JobQueue
    bases: BaseModels
    redis: redis.asyncio.Redis
    routers: dict[str, ReplicaRouter]  # by base model name: each base has its own replicas
    upstream: Upstream
    limits: RateLimiter
    events: redis.Redis  # synchronous, for announcements from sync route handlers
    metrics: ApiMetrics
    scaler: ReplicaScaler  # demand per base, cold starts, scale to zero (api/scaling)
    usage_backlog: UsageBacklog  # usage rows waiting for the database to come back

    @property
    def base_model(self) -> BaseModelInfo:
        """The default base (``LORAPLEX_BASE_MODEL``): what uploads apply to unless they name another, and the
        name this API's residency consumer group carries."""
        return self.bases.default

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A short transaction. Never hold one across network I/O: SQLite lets one writer in at a time."""
        with session_scope(self.engine) as session:
            yield session

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """A read-only transaction: on SQLite it does not queue behind writers. Never write in it."""
        with read_session(self.engine) as session:
            yield session

    def insert_or_undo(self, row: SQLModel, undo: Callable[[], None]) -> None:
        """Insert ``row`` for objects already stored; if that fails, ``undo`` removes them before re-raising,
        so the store never keeps bytes no row points at."""
        try:
            with self.session() as session:
                session.add(row)
        except BaseException:
            try:
                undo()
            except Exception:  # keep the original error; the leftover objects are only logged
                log.exception("could not remove the objects of a row that was not inserted")
            raise

    def announce_adapter_event(self, event: str, adapter: AdapterDescriptor, *, cause: str | None = None) -> None:
        """Publish ``{"event", "adapter", "cause"}`` on the adapter events channel (best effort: logged on
        failure); ``cause`` reaches the replicas' audit events."""
        message = json.dumps({"event": event, "adapter": adapter.model_dump(mode="json"), "cause": cause})
        try:
            self.events.publish(ADAPTER_EVENTS_CHANNEL, message)
        except (redis.RedisError, OSError):
            log.warning("could not announce %s of adapter %s", event, adapter.id, exc_info=True)

    async def aclose(self) -> None:
        """Release the async clients (at shutdown, in the event loop that used them)."""
        await self.upstream.client.aclose()
        await self.redis.aclose()

    def close(self) -> None:
        """Release connections (at shutdown)."""
        self.jobs.close()
        self.events.close()
        self.engine.dispose()


def build_context(settings: Settings) -> ApiContext:
    """Create the clients from settings; raises ``ConfigError`` naming a missing or bad setting.

    Nothing here connects yet, so the API starts even while Redis or S3 are down and answers 503 until
    they return.
    """
    bases = load_base_models(settings)
    url = redis_url(settings)
    # Short socket timeouts: with Redis down, a request should get its 503 in about a second.
    async_redis = redis.asyncio.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=3.0)
    routers = {base.name: ReplicaRouter(ReplicaRegistry(async_redis, base.name)) for base in bases}
    timeout = httpx.Timeout(
        connect=settings.upstream_connect_timeout_s, read=settings.upstream_read_timeout_s, write=30.0, pool=30.0
    )
    client = httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    )
    token = settings.internal_token.get_secret_value() if settings.internal_token else None
    metrics = ApiMetrics()
    scaler = ReplicaScaler(settings, bases, routers, async_redis, make_launcher(settings, bases), metrics)
    return ApiContext(
        settings=settings,
        engine=make_engine(settings.db_url),
        store=open_store(settings),
        jobs=JobQueue(make_celery(settings)),
        bases=bases,
        redis=async_redis,
        routers=routers,
        upstream=Upstream(client, token, settings.upstream_attempts),
        limits=RateLimiter(async_redis, settings),
        events=redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0),
        metrics=metrics,
        scaler=scaler,
        usage_backlog=UsageBacklog(),
    )
