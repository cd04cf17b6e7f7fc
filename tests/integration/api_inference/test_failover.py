"""Killing a replica (SIGKILL, no goodbye) while it serves an adapter: its adapter moves to the other
replica, no request that had not started streaming fails (in-flight non-streaming ones are replayed),
and a stream that had started ends with an error event instead of hanging."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from api.routing.plan import rendezvous_order
from core.local_services import EmbeddedRedis
from tests.integration.api_inference.deployment import Deployment, deploy
from tests.integration.api_inference.serving import upload_adapter
from tests.services import S3Service

pytestmark = pytest.mark.slow
LONG = {"max_tokens": 2000, "extra_body": {"ignore_eos": True}}  # seconds of decoding on the tiny model


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Deployment]:
    """Its own API and two replicas: this module kills one of them."""
    workdir = tmp_path_factory.mktemp("failover")
    deployment = deploy(workdir, redis_service.url, s3_service, tiny_model_dir)
    try:
        deployment.start_replicas(tiny_model_dir, ["replica-1", "replica-2"], workdir)
        yield deployment
    finally:
        deployment.stop()


def test_a_killed_replicas_adapter_moves_and_only_started_streams_fail(
    pair: Deployment, peft_adapter_dir: Path
) -> None:
    tenant = pair.make_tenant()
    adapter = upload_adapter(tenant, peft_adapter_dir)
    model = adapter["model"]
    client = tenant.openai(timeout=120.0)  # a hang fails the test instead of blocking it
    home, other = (r.id for r in rendezvous_order(adapter["id"], pair.heartbeats().values()))
    client.completions.create(model=model, prompt="warm up", max_tokens=2)
    assert [r.replica for r in pair.usage_records(tenant.id)] == [home]

    # Two requests in flight on the adapter's replica: a non-streaming one that has delivered nothing, and
    # a stream that has delivered text. The long one starts first, so both run when the replica dies.
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.completions.create, model=model, prompt="Another story", **LONG)
        busy = lambda: pair.replica_metric(home, "loraplex_requests_running") >= 1  # noqa: E731
        pair.wait_until(busy, f"a request to run on {home}")
        # The client asks for the usage on every chunk (vLLM's continuous_usage_stats): it knows what it got.
        options = {"include_usage": True, "continuous_usage_stats": True}
        stream = client.completions.create(
            model=model, prompt="Tell a story", stream=True, stream_options=options, **LONG
        )  # type: ignore[call-overload]
        received = next(chunk for chunk in stream if chunk.choices and chunk.choices[0].text).usage
        pair.kill_replica(home)

        with pytest.raises(openai.APIError) as broken:
            for chunk in stream:
                received = chunk.usage or received
        assert "stopped in the middle of the answer" in broken.value.message
        replayed = waiting.result(timeout=300)
    assert replayed.usage is not None and replayed.usage.completion_tokens == 2000

    # Requests after the kill, streaming or not: every one is answered, by the other replica.
    for streaming in (False, True, False, True):
        out = client.completions.create(model=model, prompt="after", max_tokens=3, stream=streaming)
        if streaming:
            assert [c for c in out if c.choices and c.choices[0].finish_reason]  # type: ignore[union-attr]
        else:
            assert out.choices[0].finish_reason  # type: ignore[union-attr]
    base = client.chat.completions.create(model=pair.base_model, messages=[{"role": "user", "content": "hi"}])
    assert base.choices[0].message is not None

    records = pair.wait_until(lambda: r if len(r := pair.usage_records(tenant.id)) == 8 else None, "all metering")
    # The started stream failed on the dead replica; the waiting request was answered by the other one.
    assert {(r.replica, r.status) for r in records[1:3]} == {(home, "upstream_failed"), (other, "completed")}
    # The broken stream is billed for what its client received, not for what the dead replica had made.
    [broken_record] = [r for r in records[1:3] if r.status == "upstream_failed"]
    assert received is not None and received.completion_tokens >= 1
    assert (broken_record.prompt_tokens, broken_record.completion_tokens) == (
        received.prompt_tokens,
        received.completion_tokens,
    )
    assert {r.replica for r in records[3:]} == {other}
    pair.wait_until(lambda: adapter["id"] in pair.heartbeats()[other].resident_adapters, "the adapter to move")
