"""Prometheus metrics of one server, in a registry of its own (no module-level metric state).

Counters and histograms are updated where things happen; gauges are read at scrape time from a
snapshot of the server's state, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server.engine.tenancy import TenantLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class GaugeSnapshot:
    """What the gauges report, read from the running server at scrape time."""

    running: int = 0
    waiting: int = 0
    pool_pages: dict[str, int] = field(default_factory=dict)  # kind: kv, kv_cached, adapter, free
    adapters_resident: dict[str, int] = field(default_factory=dict)  # tier: pool, host
    tenants: dict[str, TenantLoad] = field(default_factory=dict)  # label -> load; bounded by the caller


class _Gauges(Collector):
    def __init__(self, snapshot: Callable[[], GaugeSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        yield GaugeMetricFamily("loraplex_requests_running", "Requests the engine is generating for.", snap.running)
        yield GaugeMetricFamily(
            "loraplex_requests_waiting", "Requests queued: waiting for an adapter or for the engine.", snap.waiting
        )
        pages = GaugeMetricFamily("loraplex_pool_pages", "Pages of the unified pool by use.", labels=["kind"])
        for kind in ("kv", "kv_cached", "adapter", "free"):
            pages.add_metric([kind], snap.pool_pages.get(kind, 0))
        yield pages
        resident = GaugeMetricFamily("loraplex_adapters_resident", "Adapters held per tier.", labels=["tier"])
        for tier in ("pool", "host"):
            resident.add_metric([tier], snap.adapters_resident.get(tier, 0))
        yield resident
        sequences = GaugeMetricFamily(
            "loraplex_tenant_sequences", "Sequences per tenant, waiting or running.", labels=["tenant", "state"]
        )
        pages = GaugeMetricFamily("loraplex_tenant_kv_pages", "KV pages held per tenant.", labels=["tenant"])
        for tenant, load in snap.tenants.items():
            sequences.add_metric([tenant, "waiting"], load.waiting)
            sequences.add_metric([tenant, "running"], load.running)
            pages.add_metric([tenant], load.kv_pages)
        yield sequences
        yield pages


class _WithoutCreated(Collector):
    """The registry's metrics minus the ``*_created`` timestamps prometheus_client adds to counters/histograms,
    so the exposition holds exactly the documented metric names."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


MetricUpdates = tuple[dict[tuple[str, tuple[str, ...]], float], dict[str, list[float]]]  # increments, observations


class ServerMetrics:
    """Every metric the server exports; ``bind`` attaches the gauge snapshot once the engine is up."""

    # The counters and histograms the engine loop and adapter manager update: in an engine process they are
    # relayed to the HTTP process (``apply``), which owns the registry.
    ENGINE_UPDATED = (
        "adapter_loads", "adapter_evictions", "adapter_load_seconds", "time_to_first_token", "inter_token_latency",
        "e2e_request_latency", "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
    )  # fmt: skip

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Gauges first: a scrape then reads the published state before the counters, and the engine thread
        # counts an event (an eviction, a load) before it publishes the state the event made. A scrape whose
        # gauges show an adapter gone therefore always counts its eviction.
        self._snapshot: Callable[[], GaugeSnapshot] = GaugeSnapshot
        r.register(_Gauges(lambda: self._snapshot()))
        self.adapter_loads = Counter(
            "loraplex_adapter_loads", "Adapters placed in the pool, by the tier they came from.", ["tier"], registry=r
        )
        self.adapter_evictions = Counter(
            "loraplex_adapter_evictions", "Adapters evicted from a tier, by reason.", ["reason"], registry=r
        )
        self.adapter_load_seconds = Histogram(
            "loraplex_adapter_load_seconds", "From asking for an adapter to its being in the pool.",
            buckets=LOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "loraplex_time_to_first_token_seconds", "Arrival to first generated token (adapter loads included).",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "loraplex_inter_token_latency_seconds", "Gap between successive tokens of one request.",
            buckets=TOKEN_GAP_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_request_latency = Histogram(
            "loraplex_e2e_request_latency_seconds", "Arrival to last token.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("loraplex_generation_tokens", "Tokens generated.", registry=r)
        self.prefix_cache_queries = Counter(
            "loraplex_prefix_cache_queries", "Tokens of admitted sequences looked up in the prefix cache.", registry=r
        )
        self.prefix_cache_hits = Counter(
            "loraplex_prefix_cache_hits", "Tokens found in the prefix cache (their prefill skipped).", registry=r
        )
        self._exposed = CollectorRegistry(auto_describe=False)
        self._exposed.register(_WithoutCreated(r))

    def bind(self, snapshot: Callable[[], GaugeSnapshot]) -> None:
        """Read gauges from ``snapshot`` from now on."""
        self._snapshot = snapshot

    def apply(self, updates: MetricUpdates) -> None:
        """Add what an engine process counted and observed since its last message."""
        increments, observations = updates
        for (name, labels), amount in increments.items():
            metric = getattr(self, name)
            (metric.labels(*labels) if labels else metric).inc(amount)
        for name, values in observations.items():
            histogram = getattr(self, name)
            for value in values:
                histogram.observe(value)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self._exposed)
