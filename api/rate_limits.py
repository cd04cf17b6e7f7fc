"""Per-tenant limits on requests and tokens per minute: two token buckets per tenant, kept in Redis.

A bucket holds up to ``rate_limit_burst_seconds`` of a tenant's allowance and refills continuously, so
a client that waits ``retry-after`` seconds is admitted (a fixed window would make it wait for the
window to end). Admission takes one request and needs at least one token left; the tokens a request
used are debited when it ends (they are unknown before), so a large answer can leave the bucket in
debt and the next request waits until it is repaid. Both scripts run atomically in Redis, so any
number of API processes share the limits, on Redis' clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from core.errors import RateLimited, ServiceUnavailable
from core.models import Tenant
from core.settings import Settings

log = logging.getLogger(__name__)

KEY_PREFIX = "loraplex:ratelimit:"
REDIS_RETRY_AFTER_S = 5.0

# Shared by both scripts: the bucket level at Redis' current time, refilled since it was last written.
_REFILL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function level(key, rate, capacity)
  local saved = redis.call('HMGET', key, 'level', 'at')
  if saved[1] == false then return capacity end
  return math.min(capacity, tonumber(saved[1]) + (now - tonumber(saved[2])) * rate)
end
local function save(key, value, rate, capacity)
  redis.call('HSET', key, 'level', tostring(value), 'at', tostring(now))
  -- A bucket that has refilled is the same as no bucket: let the key go.
  redis.call('PEXPIRE', key, math.ceil((capacity - value) / rate * 1000) + 1000)
end
"""

# KEYS: requests bucket, tokens bucket. ARGV: request rate/s, capacity, token rate/s, capacity (rate 0: no limit).
# Returns {1, 0, ''} when admitted, else {0, milliseconds to wait, 'requests' | 'tokens'}.
ADMIT_SCRIPT = (
    _REFILL
    + """
local req_rate, req_cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local tok_rate, tok_cap = tonumber(ARGV[3]), tonumber(ARGV[4])
local wait, which = 0, ''
local requests, tokens
if req_rate > 0 then
  requests = level(KEYS[1], req_rate, req_cap)
  if requests < 1 then wait, which = (1 - requests) / req_rate, 'requests' end
end
if tok_rate > 0 then
  tokens = level(KEYS[2], tok_rate, tok_cap)
  if tokens < 1 and (1 - tokens) / tok_rate > wait then wait, which = (1 - tokens) / tok_rate, 'tokens' end
end
if wait > 0 then return {0, math.ceil(wait * 1000), which} end
if req_rate > 0 then save(KEYS[1], requests - 1, req_rate, req_cap) end
return {1, 0, ''}
"""
)

# KEYS: tokens bucket. ARGV: tokens used, token rate/s, capacity.
DEBIT_SCRIPT = (
    _REFILL
    + """
local used, rate, capacity = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
save(KEYS[1], level(KEYS[1], rate, capacity) - used, rate, capacity)
return 1
"""
)


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits in effect (0: unlimited) and how much may arrive at once."""

    requests_per_minute: int
    tokens_per_minute: int
    burst_seconds: float

    @classmethod
    def of(cls, tenant: Tenant, settings: Settings) -> TenantLimits:
        """The tenant's own limits where set, the platform defaults otherwise."""
        rpm = tenant.requests_per_minute
        tpm = tenant.tokens_per_minute
        return cls(
            requests_per_minute=settings.default_requests_per_minute if rpm is None else rpm,
            tokens_per_minute=settings.default_tokens_per_minute if tpm is None else tpm,
            burst_seconds=settings.rate_limit_burst_seconds,
        )

    def bucket(self, per_minute: int) -> tuple[float, float]:
        """(refill rate per second, capacity); capacity is never below one unit, or nothing would pass."""
        rate = per_minute / 60.0
        return rate, max(1.0, rate * self.burst_seconds)


def bucket_keys(tenant_id: str) -> tuple[str, str]:
    """Redis keys of a tenant's request and token buckets."""
    return f"{KEY_PREFIX}{tenant_id}:requests", f"{KEY_PREFIX}{tenant_id}:tokens"


class RateLimiter:
    """Admits or refuses a tenant's requests; Redis trouble becomes 503 with ``retry-after``."""

    def __init__(self, redis: Redis, settings: Settings) -> None:
        self.settings = settings
        self._admit = redis.register_script(ADMIT_SCRIPT)
        self._debit = redis.register_script(DEBIT_SCRIPT)

    async def admit(self, tenant: Tenant) -> None:
        """Take one request from the tenant's allowance, or raise ``RateLimited`` saying when to retry."""
        limits = TenantLimits.of(tenant, self.settings)
        if not (limits.requests_per_minute or limits.tokens_per_minute):
            return
        req_rate, req_cap = limits.bucket(limits.requests_per_minute)
        tok_rate, tok_cap = limits.bucket(limits.tokens_per_minute)
        try:
            admitted, wait_ms, which = await self._admit(
                keys=list(bucket_keys(tenant.id)), args=[req_rate, req_cap, tok_rate, tok_cap]
            )
        except (RedisError, OSError) as exc:
            raise _redis_down(exc) from exc
        if not admitted:
            which = which.decode() if isinstance(which, bytes) else str(which)
            limit = limits.requests_per_minute if which == "requests" else limits.tokens_per_minute
            raise RateLimited(
                f"rate limit of {limit} {which} per minute reached for this tenant; retry after "
                f"{int(wait_ms) / 1000:.1f}s",
                retry_after=int(wait_ms) / 1000,
                code=f"rate_limit_{which}",
            )

    async def debit_tokens(self, tenant: Tenant, tokens: int) -> None:
        """Charge the tokens a finished request used (best effort: the request already happened)."""
        limits = TenantLimits.of(tenant, self.settings)
        if tokens <= 0 or not limits.tokens_per_minute:
            return
        rate, capacity = limits.bucket(limits.tokens_per_minute)
        try:
            await self._debit(keys=[bucket_keys(tenant.id)[1]], args=[tokens, rate, capacity])
        except (RedisError, OSError):
            log.warning("could not debit %d tokens from tenant %s", tokens, tenant.id, exc_info=True)


def _redis_down(exc: BaseException) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"rate limits cannot be checked: Redis is unreachable ({type(exc).__name__}); retry shortly",
        retry_after=REDIS_RETRY_AFTER_S,
        code="redis_unavailable",
    )
