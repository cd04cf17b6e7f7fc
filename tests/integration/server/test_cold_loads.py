"""While an adapter downloads (held at a test-controlled gate), running requests keep streaming; the waiting
queue is bounded (429 + retry-after); a client that disconnects -- running or waiting -- frees what it held."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from core.descriptor import AdapterDescriptor
from core.local_services import LOOPBACK
from core.protocol import ADAPTER_FIELD, STATS_FIELD
from tests.integration.server.adapters import upload, variant
from tests.integration.server.gated_store import GatedS3Store
from tests.integration.server.harness import ServerUnderTest, served, server_config, wait_until
from tests.services import S3Service

MAX_WAITING = 2
LONG = 2000  # tokens: a request that is still running whenever the test looks
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def store(s3_service: S3Service) -> GatedS3Store:
    return GatedS3Store(s3_service.endpoint, s3_service.access_key, s3_service.secret_key, "srv-gated")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, store: GatedS3Store) -> Iterator[ServerUnderTest]:
    yield from served(server_config(tiny_model_dir, max_waiting=MAX_WAITING, max_model_len=2048), store)


@pytest.fixture
def adapter(server, store, peft_dir, tmp_path) -> AdapterDescriptor:
    """A fresh stored adapter (cold on the server)."""
    return upload(store, variant(peft_dir, tmp_path / "adapter", seed=7), server.runtime.base_name)


def ask(server: ServerUnderTest, adapter: AdapterDescriptor, max_tokens: int = 4):
    return server.client().completions.create(
        model=adapter.name, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={ADAPTER_FIELD: adapter.model_dump()},
    )  # fmt: skip


def test_a_cold_load_does_not_stall_running_requests(server, store, adapter):
    gate = store.hold(adapter.storage_prefix)
    stream = server.client().completions.create(
        model=server.runtime.base_name, prompt=PROMPT, max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    with ThreadPoolExecutor(1) as pool:
        cold = pool.submit(ask, server, adapter)
        assert gate.entered.wait(60), "the adapter download never started"
        # The download is held at the gate. The running request must keep generating meanwhile.
        held = server.metrics()
        assert held.value("loraplex_requests_waiting") == 1 and held.value("loraplex_requests_running") == 1
        start = held.value("loraplex_generation_tokens_total")
        wait_until(
            lambda: server.metrics().value("loraplex_generation_tokens_total") >= start + 50,
            "tokens of the running request while the adapter loads",
            timeout=30,
        )
        assert not cold.done() and not gate.opened.is_set()
        gate.open()
        answer = cold.result(timeout=120)
    stream.close()
    stats = getattr(answer, STATS_FIELD)
    assert stats["cold_start"] is True and stats["adapter_load_ms"] > 0
    assert answer.usage.completion_tokens == 4


def test_overload_is_refused_with_429_and_loads_are_shared(server, store, adapter):
    gate = store.hold(adapter.storage_prefix)
    with ThreadPoolExecutor(MAX_WAITING) as pool:
        waiting = [pool.submit(ask, server, adapter) for _ in range(MAX_WAITING)]
        wait_until(lambda: server.metrics().value("loraplex_requests_waiting") == MAX_WAITING, "a full queue")
        with pytest.raises(openai.RateLimitError) as refused:
            server.client().completions.create(model=server.runtime.base_name, prompt=PROMPT, max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "server_overloaded"
        gate.open()
        answers = [w.result(timeout=120) for w in waiting]
    assert all(a.usage.completion_tokens == 4 for a in answers)
    assert store.downloads[adapter.weights_key] == 1  # two requests, one download
    assert server.client().completions.create(model=server.runtime.base_name, prompt=PROMPT, max_tokens=2)


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
    metrics = server.metrics()
    generated = metrics.value("loraplex_generation_tokens_total")
    stream = server.client().completions.create(
        model=server.runtime.base_name, prompt=PROMPT, max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    busy = server.metrics()
    assert busy.value("loraplex_requests_running") == 1 and busy.value("loraplex_pool_pages", kind="kv") > 0
    stream.close()

    def freed():
        m = server.metrics()
        idle = m.value("loraplex_requests_running") == 0 and m.value("loraplex_pool_pages", kind="kv") == 0
        return m if idle else None

    after = wait_until(freed, "the aborted request's pages to be freed")
    assert after.value("loraplex_generation_tokens_total") - generated < LONG


def test_a_client_that_disconnects_while_waiting_leaves_the_queue(server, store, adapter):
    gate = store.hold(adapter.storage_prefix)
    prompts_before = server.metrics().value("loraplex_prompt_tokens_total")
    body = json.dumps(
        {"model": adapter.name, "prompt": PROMPT, "max_tokens": 4, ADAPTER_FIELD: adapter.model_dump()}
    ).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection((LOOPBACK, port)) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.config.internal_token}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        assert gate.entered.wait(60)
        wait_until(lambda: server.metrics().value("loraplex_requests_waiting") == 1, "the request to queue")
    wait_until(lambda: server.metrics().value("loraplex_requests_waiting") == 0, "the request to leave the queue")
    gate.open()
    answer = ask(server, adapter)  # the load itself went on, for whoever asks next
    assert answer.usage.completion_tokens == 4
    # Only this second request ever reached the engine.
    assert server.metrics().value("loraplex_prompt_tokens_total") - prompts_before == answer.usage.prompt_tokens
