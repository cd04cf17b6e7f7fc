"""Inference servers for tests: the real app under a real uvicorn on a loopback port, in this process.

In-process servers start in about a second (torch is already imported) and let a test reach the object
store the server reads through (e.g. a gate on downloads). ``test_cli_server`` covers the subprocess path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from openai import OpenAI

from core.storage import ObjectStore
from server.config import ServerConfig
from server.http import create_app
from server.runtime import ServerRuntime
from tests.integration.api.live_server import LiveServer, serve
from tests.prometheus import Metrics

T = TypeVar("T")
TOKEN = "internal-" + uuid.uuid4().hex
START_TIMEOUT_S = 120.0
# For tests that count tokens: requests sample at temperature 1 by default, and a sampled end-of-sequence token
# would cut an answer short.
NO_EOS = {"ignore_eos": True}


def wait_until(probe: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.02)


@dataclass
class ServerUnderTest:
    live: LiveServer
    config: ServerConfig

    @property
    def url(self) -> str:
        return self.live.url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.internal_token}"} if self.config.internal_token else {}

    def client(self, **kwargs: object) -> OpenAI:
        """An openai SDK client holding the internal token, no retries unless asked."""
        options: dict = {"max_retries": 0, "timeout": 120.0, **kwargs}
        return OpenAI(base_url=f"{self.url}/v1", api_key=self.config.internal_token or "unused", **options)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120.0)

    def metrics(self) -> Metrics:
        response = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=30.0)
        response.raise_for_status()
        return Metrics(response.text)

    @property
    def runtime(self) -> ServerRuntime:
        runtime = self.live.app.state.holder.runtime
        assert runtime is not None
        return runtime

    def stop(self) -> None:
        self.live.stop()


def start_server(config: ServerConfig, store: ObjectStore | None = None) -> ServerUnderTest:
    """Serve ``config`` and wait until ``/ready``."""
    server = ServerUnderTest(serve(create_app(config, store=store)), config)

    def ready() -> bool:
        return httpx.get(f"{server.url}/ready", headers=server.headers, timeout=5.0).status_code == 200

    wait_until(ready, "the server to become ready", timeout=START_TIMEOUT_S)
    return server


def server_config(model: Path, **overrides: object) -> ServerConfig:
    """A small, single-threaded server config for tests. The engine runs on a thread of this process unless
    ``engine_process=True`` (what ``loraplex server`` runs): a test may then reach the object store it reads."""
    values: dict = {"model": model, "max_model_len": 512, "pool_bytes": 4 << 20, "num_threads": 1,
                    "internal_token": TOKEN, "engine_process": False}  # fmt: skip
    values.update(overrides)
    return ServerConfig(**values)


@contextmanager
def running(config: ServerConfig, store: ObjectStore | None = None) -> Iterator[ServerUnderTest]:
    """A started server, stopped on leaving the block."""
    server = start_server(config, store)
    try:
        yield server
    finally:
        server.stop()


def served(config: ServerConfig, store: ObjectStore | None = None) -> Iterator[ServerUnderTest]:
    """A fixture body: ``yield from served(config, store)``."""
    with running(config, store) as server:
        yield server
