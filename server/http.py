"""The inference server's HTTP surface: OpenAI-compatible generation, vLLM-compatible adapter loading, probes.

The engine is built on a background thread when the app starts, so ``/health`` answers at once while
weights load; ``/ready`` turns 200 once the engine thread is stepping. If the engine cannot start, or stops
later on its own (a failed step, a dead tensor-parallel rank), the app calls ``on_engine_failure`` (``loraplex
server`` then exits non-zero, for its supervisor to restart it) and answers 503 until it is stopped. Every
route but ``/health`` needs the internal token when one is configured.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from core.errors import InvalidRequest, ServiceUnavailable
from core.storage import ObjectStore
from server.adapters.registry import KnownAdapter
from server.adapters.sources import LocalSource
from server.auth import require_token
from server.completions import CompletionService
from server.config import ServerConfig
from server.http_errors import install_error_handlers
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.openai_schemas import ChatCompletionRequest, CompletionRequest, LoadAdapterRequest, UnloadAdapterRequest
from server.runtime import ServerRuntime

log = logging.getLogger(__name__)

LOADING_RETRY_S = 5.0
WATCH_INTERVAL_S = 0.5  # how often a started app checks that its engine still runs


class EngineStopped(RuntimeError):
    """The engine of a started server stopped on its own: the server can no longer answer."""


class RuntimeHolder:
    """Builds the runtime off the event loop and hands it out once ready."""

    def __init__(
        self,
        config: ServerConfig,
        metrics: ServerMetrics,
        store: ObjectStore | None,
        on_failure: Callable[[Exception], None] | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.store = store
        self.on_failure = on_failure
        self.runtime: ServerRuntime | None = None
        self.service: CompletionService | None = None
        self.error: Exception | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._build, name="engine-build", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _build(self) -> None:
        try:
            runtime = ServerRuntime(self.config, self.metrics, self.store)
        except Exception as exc:
            log.exception("the engine failed to start")
            self.error = exc
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        with self._lock:
            if self._closed:
                runtime.close()
                return
            runtime.start()
            self.service = CompletionService(runtime)
            self.runtime = runtime
        log.info("serving %s as %r (replica %s)", self.config.model, runtime.base_name, self.config.replica_id)
        if self.on_failure is not None:
            self._watch(runtime)

    def _watch(self, runtime: ServerRuntime) -> None:
        """Until the app stops: an engine that stops on its own is reported as a failure (on the build thread)."""
        while not self._closed:
            if not runtime.loop.alive:
                if not self._closed:
                    failure = runtime.loop.failure
                    log.error("the engine stopped serving: %s", failure or "no reason given")
                    self.on_failure(EngineStopped(str(failure or "it stopped without a reason")))
                return
            time.sleep(WATCH_INTERVAL_S)

    def get(self) -> tuple[ServerRuntime, CompletionService]:
        """The running runtime, or 503 while it loads (or after it failed)."""
        if self.error is not None:
            raise ServiceUnavailable(f"the engine failed to start: {self.error}", code="engine_failed")
        runtime, service = self.runtime, self.service
        if runtime is None or service is None:
            raise ServiceUnavailable("the model is still loading", retry_after=LOADING_RETRY_S, code="loading")
        if not runtime.loop.alive:
            raise ServiceUnavailable("the inference engine is not running", code="engine_failed")
        return runtime, service

    def close(self) -> None:
        with self._lock:
            self._closed = True
            runtime = self.runtime
        if runtime is not None:
            runtime.close()


def create_app(
    config: ServerConfig,
    *,
    store: ObjectStore | None = None,
    on_engine_failure: Callable[[Exception], None] | None = None,
) -> FastAPI:
    """The server app for ``config``; ``store`` is where descriptors point (None: descriptors are refused);
    ``on_engine_failure`` is called (on the build thread) with the error when the engine cannot start, or when it
    stops later without being asked to."""
    metrics = ServerMetrics()
    holder = RuntimeHolder(config, metrics, store, on_engine_failure)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        holder.start()
        yield
        await asyncio.to_thread(holder.close)

    app = FastAPI(title="loraplex inference server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.holder = holder
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        """The process is up (the model may still be loading)."""
        return {"status": "ok"}

    guarded = APIRouter(dependencies=[Depends(require_token(config.internal_token))])

    @guarded.get("/ready")
    async def ready() -> dict:
        """The engine thread is stepping and requests are accepted."""
        runtime, _ = holder.get()
        return {"status": "ready", "replica": config.replica_id, "model": runtime.base_name}

    @guarded.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @guarded.get("/v1/models")
    async def models() -> dict:
        runtime, _ = holder.get()
        base = runtime.base_name
        data = [
            {
                "id": base,
                "object": "model",
                "created": int(runtime.started_at),
                "owned_by": "loraplex",
                "root": base,
                "parent": None,
                "max_model_len": runtime.front.max_model_len,
            }
        ]
        data += [_model_card(known, base) for known in runtime.registry.adapters()]
        return {"object": "list", "data": data}

    @guarded.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        _, service = holder.get()
        return await service.completion(request, body)

    @guarded.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        _, service = holder.get()
        return await service.chat(request, body)

    @guarded.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterRequest) -> dict:
        """Load a local adapter (``lora_path`` under --adapter-root) or a stored one (``adapter`` descriptor)."""
        runtime, _ = holder.get()
        if (body.lora_path is None) == (body.adapter is None):
            raise InvalidRequest("give either lora_path (a local directory) or adapter (a descriptor)")
        if body.adapter is not None:
            if body.adapter.name != body.lora_name:
                raise InvalidRequest("lora_name must equal the descriptor's name", param="lora_name")
            known = runtime.registry.register_descriptor(body.adapter)
        else:
            assert body.lora_path is not None
            known = runtime.registry.register_local(body.lora_name, body.lora_path)
        # A refused adapter is unlisted again (runtime._adapter_failed).
        await runtime.loop.wait_resident(known, pinned=body.pinned, cause=body.cause)
        return {"object": "lora_adapter", "id": known.name, "status": "loaded", "pinned": bool(body.pinned)}

    @guarded.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterRequest) -> dict:
        """Forget an adapter; requests already using it finish, then it leaves the pool and host RAM."""
        runtime, _ = holder.get()
        known = runtime.registry.unregister(body.lora_name)
        runtime.loop.forget(known.key, body.cause)
        return {"object": "lora_adapter", "id": known.name, "status": "unloaded"}

    app.include_router(guarded)
    return app


def _model_card(known: KnownAdapter, base: str) -> dict:
    source = known.source
    root = source.relative if isinstance(source, LocalSource) else known.adapter_id
    return {
        "id": known.name,
        "object": "model",
        "created": known.created,
        "owned_by": "loraplex",
        "root": root,
        "parent": base,
    }
