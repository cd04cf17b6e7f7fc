"""The wire contract between the control plane (`api/`, `worker/`) and inference servers (`server/`).

Requests: the API forwards OpenAI `/v1/completions` and `/v1/chat/completions` bodies to a replica
unchanged except for two things: ``model`` is the adapter's public name (or the base model's), and the
field :data:`ADAPTER_FIELD` carries the :class:`~core.descriptor.AdapterDescriptor` the server
fetches, verifies and places the adapter by. Only callers holding the internal token
(``Authorization: Bearer <LORAPLEX_INTERNAL_TOKEN>``) may send it.

The field :data:`TENANT_FIELD` (a :class:`TenantTag`), also from internal-token holders only, says whose
the request is: the server schedules tenants fairly by weight and keeps their prefix caches apart. A
request without it is the server's one direct tenant.

Answers: the server adds :data:`STATS_FIELD` (a :class:`RequestStats`) at the top level of a
non-streaming response and of the final chunk of a stream (the usage chunk when
``stream_options.include_usage`` is set, which the API always asks for and strips if its client
did not).

Discovery: every server writes its :class:`ReplicaStatus` as JSON to :func:`replica_key` every
:data:`HEARTBEAT_S` seconds with a TTL of :data:`REPLICA_TTL_S`; a replica whose key expired is gone.
Adapter residency is reported as increments on the Redis stream :data:`RESIDENCY_STREAM`, and what a
replica does to adapters' bytes (verify, refuse, load, evict) as :class:`AdapterAuditEvent` entries on
:data:`AUDIT_STREAM` (field ``event``: its JSON), which the API stores as the audit trail.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ADAPTER_FIELD = "adapter"
TENANT_FIELD = "tenant"
STATS_FIELD = "loraplex"
REQUEST_ID_HEADER = "X-Request-Id"

REPLICA_KEY_PREFIX = "loraplex:replica:"
HEARTBEAT_S = 2.0
REPLICA_TTL_S = 10.0
RESIDENCY_STREAM = "loraplex:residency"  # entries: adapter_id, page_seconds, replica, at (unix seconds)
RESIDENCY_STREAM_MAXLEN = 100_000
AUDIT_STREAM = "loraplex:audit"
AUDIT_STREAM_MAXLEN = 100_000
CAUSE_PATTERN = r"^[A-Za-z0-9_.:@/-]{1,128}$"  # request:<id>, job:<id>, tenant:<id>: what caused a load or unload


def replica_key(replica_id: str) -> str:
    """Redis key holding one replica's status."""
    return REPLICA_KEY_PREFIX + replica_id


class TenantTag(BaseModel):
    """Whose a proxied request is, for the server's fair scheduling and prefix-cache isolation."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64)
    weight: float = Field(default=1.0, gt=0, le=1000, description="Share of a busy server relative to other tenants.")


class RequestStats(BaseModel):
    """What one request cost on the server, for metering."""

    replica: str
    cold_start: bool = Field(description="The adapter was not in the pool when the request arrived.")
    adapter_load_ms: float | None = Field(default=None, description="Time waiting for the adapter to load.")
    queue_ms: float = Field(description="Arrival to first scheduled step.")
    gpu_seconds: float = Field(description="This request's share of the engine steps it took part in.")


class PoolPages(BaseModel):
    total: int
    kv: int
    adapter: int
    free: int
    page_bytes: int
    kv_cached: int = 0  # prefix-cache pages: evictable, so as good as free for new work


class TenantLoad(BaseModel):
    """One tenant's load on a replica: sequences queued and running, and the KV pages they hold."""

    tenant: str = Field(description='A tenant id; "direct" for callers without the API, "other" for the rest.')
    waiting: int
    running: int
    kv_pages: int


class ReplicaStatus(BaseModel):
    """A server's heartbeat: where it is, how busy, and which adapters it holds warm."""

    id: str
    url: str = Field(description="Base URL the API reaches it at, e.g. http://10.0.0.5:8001")
    base_model: str
    started_at: float
    updated_at: float
    running: int
    waiting: int
    max_waiting: int
    pool: PoolPages
    resident_adapters: list[str] = Field(default_factory=list, description="Adapter ids in the pool.")
    host_adapters: list[str] = Field(default_factory=list, description="Adapter ids cached in host RAM.")
    tenants: list[TenantLoad] = Field(default_factory=list, description="The busiest tenants, then the rest.")

    @property
    def overloaded(self) -> bool:
        """Its waiting queue is at least three quarters full: route new work elsewhere if possible."""
        return self.waiting >= 0.75 * self.max_waiting


class AdapterAuditEvent(BaseModel):
    """One thing a replica did to an adapter's bytes, for the audit trail (``core.audit``)."""

    action: Literal["verify", "refuse", "load", "evict"]
    adapter_id: str | None = Field(description="The adapter's id; None for a server's local adapters.")
    adapter_name: str
    sha256: str | None = Field(default=None, description="Of adapter_model.safetensors, where the replica knows it.")
    tier: str = Field(description="Where the bytes came from (store, local, host) or where they left (pool, host).")
    reason: str = Field(
        description="request, prefetch; idle, pressure, unload, manual, host_idle, host_lru; an error code."
    )
    cause: str | None = Field(default=None, description="The request or job behind it: request:<id>, job:<id>.")
    detail: str | None = Field(default=None, max_length=1000, description="A refusal's message.")
    at: float = Field(description="Unix seconds.")
    replica: str = ""
