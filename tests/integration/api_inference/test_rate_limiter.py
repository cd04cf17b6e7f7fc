"""The token buckets in real Redis: burst, refill, debt from tokens used, unlimited tenants."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from api.rate_limits import RateLimiter
from core.errors import RateLimited
from core.local_services import EmbeddedRedis
from core.models import Tenant
from core.settings import load_settings


def limiter_for(redis: Redis, burst_seconds: float) -> RateLimiter:
    settings = load_settings(
        default_requests_per_minute=0, default_tokens_per_minute=0, rate_limit_burst_seconds=burst_seconds
    )
    return RateLimiter(redis, settings)


def tenant(**limits: int) -> Tenant:
    return Tenant(id=f"tenant-{uuid.uuid4().hex}", name="t", **limits)


def run(redis_service: EmbeddedRedis, scenario) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        redis = Redis.from_url(redis_service.url)
        try:
            await scenario(redis)
        finally:
            await redis.aclose()

    asyncio.run(main())


def test_a_burst_passes_then_the_next_request_waits_for_one_refill(redis_service: EmbeddedRedis) -> None:
    async def scenario(redis: Redis) -> None:
        limiter, t = limiter_for(redis, burst_seconds=60), tenant(requests_per_minute=3)  # 3 at once, then 1 per 20 s
        for _ in range(3):
            await limiter.admit(t)
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(t)
        assert 15 < refused.value.retry_after <= 20
        assert refused.value.code == "rate_limit_requests"

    run(redis_service, scenario)


def test_tokens_used_put_the_bucket_in_debt_until_repaid(redis_service: EmbeddedRedis) -> None:
    async def scenario(redis: Redis) -> None:
        limiter, t = limiter_for(redis, burst_seconds=1), tenant(tokens_per_minute=60)  # 1 token/s, bucket of 1
        await limiter.admit(t)
        await limiter.debit_tokens(t, 100)
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(t)
        assert 90 < refused.value.retry_after <= 100
        assert refused.value.code == "rate_limit_tokens"

    run(redis_service, scenario)


def test_zero_means_unlimited_and_tenants_have_their_own_buckets(redis_service: EmbeddedRedis) -> None:
    async def scenario(redis: Redis) -> None:
        limiter = limiter_for(redis, burst_seconds=1)
        free, other, limited = (
            tenant(requests_per_minute=0),
            tenant(requests_per_minute=60),
            tenant(requests_per_minute=60),
        )
        for _ in range(50):
            await limiter.admit(free)
        await limiter.admit(limited)
        with pytest.raises(RateLimited):
            await limiter.admit(limited)
        await limiter.admit(other)

    run(redis_service, scenario)
