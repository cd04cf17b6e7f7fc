"""One ``UsageRecord(kind="inference")`` per request that reached a replica, however it ended."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from core.models import Tenant, UsageRecord

log = logging.getLogger(__name__)


class Outcome:
    """How a request ended, as stored in ``UsageRecord.status``."""

    COMPLETED = "completed"
    REJECTED = "rejected"  # the replica refused it (4xx), e.g. the prompt exceeds the context
    CLIENT_DISCONNECTED = "client_disconnected"
    UPSTREAM_FAILED = "upstream_failed"  # the replica broke off after the answer had started
    UPSTREAM_ERROR = "upstream_error"  # the replica reported an error inside the stream


@dataclass
class InferenceMeter:
    """What one request cost, filled in as the answer passes through."""

    tenant: Tenant
    model: str
    adapter_id: str | None
    request_id: str
    base_model: str = ""  # which base's replicas served it (metrics, scale-to-zero activity)
    started: float = field(default_factory=time.monotonic)
    replica: str | None = None
    usage: dict[str, Any] | None = None  # the server's count: the whole answer's, or a stream's so far
    stats: dict[str, Any] | None = None
    first_output_at: float | None = None
    status: str = Outcome.COMPLETED
    finished: bool = False  # charged and recorded

    def saw_output(self, pieces: int) -> None:
        if pieces and self.first_output_at is None:
            self.first_output_at = time.monotonic()

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens: the server's count as of the last chunk relayed (streams carry it on
        every chunk), so a stream cut short is billed for what went out; nothing when no output did."""
        usage = self.usage or {}
        return _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens"))

    def cached_tokens(self) -> int:
        """Prompt tokens the server found in its prefix cache (``usage.prompt_tokens_details.cached_tokens``)."""
        details = (self.usage or {}).get("prompt_tokens_details")
        return min(_int(details.get("cached_tokens")), self.tokens()[0]) if isinstance(details, dict) else 0

    def limited_tokens(self, charge_cached: bool) -> int:
        """Tokens debited from the tenant's tokens-per-minute budget: cached prompt tokens count only when
        ``charge_cached`` (``LORAPLEX_CHARGE_CACHED_TOKENS``), as they cost the server almost nothing."""
        prompt, completion = self.tokens()
        return prompt - (0 if charge_cached else self.cached_tokens()) + completion

    def record(self) -> UsageRecord:
        """The row to store, at the end of the request."""
        stats = self.stats or {}
        prompt, completion = self.tokens()
        ended = time.monotonic()
        return UsageRecord(
            tenant_id=self.tenant.id,
            kind="inference",
            model=self.model,
            adapter_id=self.adapter_id,
            request_id=self.request_id,
            replica=str(stats.get("replica") or self.replica or "") or None,
            prompt_tokens=prompt,
            cached_tokens=self.cached_tokens(),
            completion_tokens=completion,
            gpu_seconds=float(stats.get("gpu_seconds") or 0.0),
            latency_ms=(ended - self.started) * 1000,
            ttft_ms=None if self.first_output_at is None else (self.first_output_at - self.started) * 1000,
            cold_start=bool(stats.get("cold_start", False)),
            status=self.status,
        )


def _int(value: object) -> int:
    return value if isinstance(value, int) and value > 0 else 0
