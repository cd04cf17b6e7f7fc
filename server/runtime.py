"""One server's moving parts, built and wired from its config: the engine (a process or a thread), the adapter
names it serves, Redis links."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from core.errors import LoraplexError
from core.protocol import PoolPages, ReplicaStatus, TenantLoad
from core.storage import ObjectStore
from server.adapters.registry import AdapterRegistry, KnownAdapter
from server.adapters.sources import adapter_id_of_key
from server.audit import AuditTrail
from server.config import ServerConfig
from server.engine.tenancy import TenantLoad as EngineTenantLoad
from server.engine_loop import EngineLoop
from server.engine_process import EngineProcess
from server.local_engine import LocalEngine
from server.metrics import GaugeSnapshot, ServerMetrics
from server.replica_registry import ReplicaPublisher


class ServerRuntime:
    """Builds the engine (slow: weights, tokenizer), in this process or its own, and everything around it;
    ``start`` then ``close``."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics, store: ObjectStore | None) -> None:
        self.config = config
        self.metrics = metrics
        self.started_at = time.time()
        self.base_name = config.base_name
        self.registry = AdapterRegistry(self.base_name, config.adapter_root)
        self.audit = AuditTrail(config.replica_id)
        self._local: LocalEngine | None = None
        if config.engine_process:
            self.loop: EngineLoop | EngineProcess = EngineProcess(config, metrics, store)
            self.loop.on_audit = self.audit.record
            self.front = self.loop.front
        else:
            self._local = LocalEngine(config, metrics, store, self.audit.record)
            self.loop, self.front = self._local.loop, self._local.front
        self.loop.on_adapter_error = self._adapter_failed
        self.publisher: ReplicaPublisher | None = None
        if config.redis_url:
            self.publisher = ReplicaPublisher(
                config.redis_url,
                config.replica_id,
                self.replica_status,
                self.residency,
                config.heartbeat_s,
                audit=self.audit,
            )

    def start(self) -> None:
        self.loop.start()
        self.metrics.bind(self.gauges)
        if self.publisher is not None:
            self.publisher.start()

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        else:
            self.loop.stop()
        if self.publisher is not None:
            self.publisher.stop()

    # ----- views ---------------------------------------------------------------------------------------

    def gauges(self) -> GaugeSnapshot:
        counts = self.loop.counts()
        view = self.loop.view
        pool, tiers = view.pool, view.tiers
        return GaugeSnapshot(
            running=counts.running,
            waiting=counts.waiting,
            pool_pages={
                "kv": pool.kv_pages,
                "kv_cached": pool.kv_cached_pages,
                "adapter": pool.adapter_pages,
                "free": pool.free_pages,
            },
            adapters_resident={"pool": len(tiers.resident), "host": len(tiers.host)},
            tenants=busiest_tenants(view.tenants),
        )

    def replica_status(self) -> ReplicaStatus:
        counts = self.loop.counts()
        view = self.loop.view
        pool, tiers = view.pool, view.tiers
        return ReplicaStatus(
            id=self.config.replica_id,
            url=self.config.url,
            base_model=self.base_name,
            started_at=self.started_at,
            updated_at=time.time(),
            running=counts.running,
            waiting=counts.waiting,
            max_waiting=self.config.max_waiting,
            pool=PoolPages(
                total=pool.total_pages,
                kv=pool.kv_pages,
                adapter=pool.adapter_pages,
                free=pool.free_pages,
                page_bytes=pool.page_bytes,
                kv_cached=pool.kv_cached_pages,
            ),
            resident_adapters=_adapter_ids(tiers.resident),
            host_adapters=_adapter_ids(tiers.host),
            tenants=[
                TenantLoad(tenant=label, waiting=load.waiting, running=load.running, kv_pages=load.kv_pages)
                for label, load in busiest_tenants(view.tenants).items()
            ],
        )

    def residency(self) -> dict[str, float]:
        """Page-seconds per stored adapter id since the last call (local adapters are not metered)."""
        totals: dict[str, float] = {}
        for key, seconds in self.loop.drain_residency().items():
            adapter_id = adapter_id_of_key(key)
            if adapter_id is not None:
                totals[adapter_id] = totals.get(adapter_id, 0.0) + seconds
        return totals

    def _adapter_failed(self, known: KnownAdapter, error: LoraplexError) -> None:
        """A refused adapter stops being listed; one that failed for a transient reason (5xx) stays."""
        if error.status_code < 500:
            self.registry.discard(known)


BUSIEST_TENANTS = 8  # tenants shown by name in metrics and heartbeats; the rest add up as "other"


def busiest_tenants(loads: Mapping[str, EngineTenantLoad], limit: int = BUSIEST_TENANTS) -> dict[str, EngineTenantLoad]:
    """The ``limit`` tenants with the most sequences (then pages), by label, and the rest summed as ``other``:
    metric label sets stay bounded however many tenants a server sees."""
    ranked = sorted(loads.items(), key=lambda item: (-(item[1].waiting + item[1].running), -item[1].kv_pages, item[0]))
    shown = {tenant or "direct": load for tenant, load in ranked[:limit]}
    if len(ranked) > limit:
        rest = EngineTenantLoad()
        for _, load in ranked[limit:]:
            rest.add(load)
        shown["other"] = rest
    return shown


def _adapter_ids(keys: Iterable[str]) -> list[str]:
    ids = {adapter_id_of_key(key) for key in keys}
    return sorted(i for i in ids if i is not None)
