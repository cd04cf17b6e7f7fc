"""The API's Prometheus metrics (``GET /metrics``): per base model, the demand an autoscaler scales replicas on,
and the requests and cold starts behind it. Gauges are read from the scaler at each scrape; every API process
reports its own view (sum ``running``/``waiting`` across processes, take the ``max`` of ``replicas_wanted``).
Names are listed in docs/operations.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from api.scaling.scaler import ReplicaScaler

COLD_START_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class ApiMetrics:
    """One API process's registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["base_model"]
        r = self.registry
        self.requests = Counter(
            "loraplex_api_requests",
            "Inference requests by outcome: completed, rejected, client_disconnected, upstream_failed, upstream_error "
            "(after a replica took them); unavailable, overloaded (no replica could).",
            [*labels, "outcome"],
            registry=r,
        )
        self.running = Gauge(
            "loraplex_api_requests_running", "Requests this process has in flight at replicas.", labels, registry=r
        )
        self.waiting = Gauge(
            "loraplex_api_requests_waiting",
            "Requests this process holds until a replica starts (scale from zero).",
            labels,
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "loraplex_api_tokens_per_second",
            "Output tokens delivered per second, over the last minute.",
            labels,
            registry=r,
        )
        self.replicas_live = Gauge(
            "loraplex_api_replicas_live", "Replicas heartbeating for the base.", labels, registry=r
        )
        self.replicas_wanted = Gauge(
            "loraplex_api_replicas_wanted",
            "Replicas the base's load asks for: 0 once idle past LORAPLEX_REPLICA_IDLE_TTL, else one per "
            "LORAPLEX_REPLICA_TARGET_REQUESTS requests in flight or held (at least 1, at most LORAPLEX_REPLICA_MAX).",
            labels,
            registry=r,
        )
        self.idle_seconds = Gauge(
            "loraplex_api_idle_seconds",
            "Seconds since any API process started or finished a request.",
            labels,
            registry=r,
        )
        self.cold_starts = Counter(
            "loraplex_api_cold_starts",
            "Replica starts for held requests, by outcome.",
            [*labels, "outcome"],
            registry=r,
        )
        self.cold_start_seconds = Histogram(
            "loraplex_api_cold_start_seconds",
            "From the first held request to the started replica's heartbeat.",
            labels,
            buckets=COLD_START_BUCKETS,
            registry=r,
        )
        self.scale_downs = Counter(
            "loraplex_api_scale_downs", "Times a base's replicas were stopped for idleness.", labels, registry=r
        )

    async def render(self, scaler: ReplicaScaler) -> bytes:
        """The exposition text, with the gauges read now."""
        for base in scaler.bases.names:
            in_flight, held = scaler.busy(base)
            self.running.labels(base).set(in_flight)
            self.waiting.labels(base).set(held)
            self.tokens_per_second.labels(base).set(scaler.demand[base].tokens.per_second())
            try:
                live = len(await scaler.routers[base].registry.live())
            except Exception:  # Redis down: the gauge keeps its last value rather than failing the scrape
                live = None
            if live is not None:
                self.replicas_live.labels(base).set(live)
            idle = await scaler.idle_for(base)
            self.idle_seconds.labels(base).set(idle)
            self.replicas_wanted.labels(base).set(scaler.wanted(base, idle))
        return generate_latest(self.registry)
