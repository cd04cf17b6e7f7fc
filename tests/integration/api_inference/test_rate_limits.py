"""Per-tenant rate limits through the SDK: 429 with a retry-after the SDK's own retry waits out, token
limits, tenants kept apart; and with Redis down, 503 with retry-after rather than a 500."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from api.app import create_app
from core.local_services import free_port
from tests.integration.api.conftest import TenantHandle
from tests.integration.api.live_server import serve
from tests.integration.api_inference.deployment import Deployment

pytestmark = pytest.mark.slow


def status_log(tenant: TenantHandle, max_retries: int) -> tuple[openai.OpenAI, list[int]]:
    """An SDK client that records the status of every HTTP response it receives, retries included."""
    statuses: list[int] = []
    http_client = openai.DefaultHttpxClient(event_hooks={"response": [lambda r: statuses.append(r.status_code)]})
    return tenant.openai(max_retries=max_retries, http_client=http_client), statuses


def ask(client: openai.OpenAI, model: str) -> None:
    client.completions.create(model=model, prompt="hi", max_tokens=2)


def test_over_the_request_limit_the_sdk_waits_retry_after_and_gets_through(serving: Deployment) -> None:
    # 30/min with 2 s of burst: one request at once, then one every 2 s. The SDK's own backoff without
    # retry-after would be under 0.5 s and its single retry would be refused again.
    tenant = serving.make_tenant(requests_per_minute=30)
    ask(tenant.openai(), serving.base_model)

    with pytest.raises(openai.RateLimitError) as refused:
        ask(tenant.openai(), serving.base_model)
    assert refused.value.code == "rate_limit_requests"
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 2

    client, statuses = status_log(tenant, max_retries=1)
    ask(client, serving.base_model)
    assert statuses == [429, 200]


def test_tokens_used_count_against_the_token_limit(serving: Deployment) -> None:
    tenant = serving.make_tenant(tokens_per_minute=60)  # a bucket of 2 tokens: one request empties it
    ask(tenant.openai(), serving.base_model)
    with pytest.raises(openai.RateLimitError) as refused:
        ask(tenant.openai(), serving.base_model)
    assert refused.value.code == "rate_limit_tokens"
    assert int(refused.value.response.headers["retry-after"]) >= 1


def test_one_tenants_limit_does_not_touch_another(serving: Deployment) -> None:
    limited = serving.make_tenant(requests_per_minute=1)
    free = serving.make_tenant()
    ask(limited.openai(), serving.base_model)
    with pytest.raises(openai.RateLimitError):
        ask(limited.openai(), serving.base_model)
    for _ in range(3):
        ask(free.openai(), serving.base_model)


@pytest.fixture
def api_without_redis_url(serving: Deployment) -> Iterator[str]:
    """The serving deployment's API settings and database, with a Redis nothing listens on."""
    settings = serving.settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    server = serve(create_app(settings))
    yield server.url
    server.stop()


@pytest.mark.parametrize("limited", [True, False], ids=["limits-checked", "registry-read"])
def test_with_redis_down_inference_answers_503_with_retry_after(
    serving: Deployment, api_without_redis_url: str, limited: bool
) -> None:
    tenant = serving.make_tenant(requests_per_minute=1000) if limited else serving.make_tenant()
    client = openai.OpenAI(base_url=f"{api_without_redis_url}/v1", api_key=tenant.key, max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as exc:
            client.completions.create(model=serving.base_model, prompt="hi", max_tokens=2, stream=stream)
        assert exc.value.status_code == 503
        assert exc.value.code == "redis_unavailable"
        assert ("rate limits" in exc.value.message) == limited
        assert int(exc.value.response.headers["retry-after"]) >= 1
