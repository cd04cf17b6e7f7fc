"""The engine and its adapter tiers in this process: the engine loop's thread, the loader threads, a scratch
directory for downloads. The HTTP process builds one when the engine runs beside it; the engine process
(``server.engine_process``) builds one of its own."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from core.base_fingerprint import fingerprint_base
from core.protocol import AdapterAuditEvent
from core.storage import ObjectStore
from server.adapters.fetch import AdapterFetcher
from server.adapters.host_cache import HostCache
from server.adapters.manager import AdapterLimits, AdapterManager
from server.config import ServerConfig
from server.engine import LLMEngine
from server.engine.front import EngineFront
from server.engine_loop import EngineLoop
from server.metrics import ServerMetrics


class LocalEngine:
    """Builds the engine (slow: weights, tokenizer) and wires its loop and adapter manager; ``close`` undoes it."""

    def __init__(
        self,
        config: ServerConfig,
        metrics: ServerMetrics,
        store: ObjectStore | None,
        audit: Callable[[AdapterAuditEvent], None] | None = None,
    ) -> None:
        self.engine = LLMEngine(config.engine_config())
        self.loop = EngineLoop(self.engine, metrics, config.replica_id, max_waiting=config.max_waiting)
        self._scratch = Path(tempfile.mkdtemp(prefix="loraplex-server-"))
        fetcher = AdapterFetcher(
            store,
            self.engine.model_config.base_shapes(),
            config.max_lora_rank,
            self._scratch,
            config.adapter_root,
            base=fingerprint_base(config.model, config.base_name),
        )
        limits = AdapterLimits(
            max_resident=config.max_resident_adapters,
            pool_idle_ttl=config.adapter_idle_ttl,
            reserve_pages=int(self.engine.config.watermark * self.engine.pool_stats().total_pages),
        )
        host = HostCache(config.host_cache_bytes, config.host_idle_ttl)
        self.loop.manager = AdapterManager(
            self.engine, fetcher, host, limits, metrics, self.loop.post, load_workers=config.load_workers, audit=audit
        )

    @property
    def front(self) -> EngineFront:
        return self.engine.front()

    def close(self) -> None:
        self.loop.stop()
        self.engine.close()
        shutil.rmtree(self._scratch, ignore_errors=True)
