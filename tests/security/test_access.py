"""Who gets in where, over every route the API's OpenAPI schema lists: no key, a revoked key, the internal
token and a tenant key on admin routes are all refused; the servers' routes refuse everything but the
internal token; fields only the API may set get a client nothing; and one tenant's rate limit holds under
a burst of concurrent requests without touching another tenant."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from core.protocol import ADAPTER_FIELD, STATS_FIELD
from tests.integration.api.conftest import TenantHandle
from tests.integration.api_inference.deployment import Deployment
from tests.integration.api_inference.serving import upload_adapter
from tests.security.contract import Refusal, assert_refused, assert_still_serving, stores_nothing

pytestmark = pytest.mark.slow
PUBLIC = {"/health", "/ready", "/admin/login", "/admin/logout"}  # probes, and the dashboard's sign-in flow
SERVER_ROUTES = [
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
]


def operations(deployment: Deployment, prefix: str) -> list[tuple[str, str]]:
    """(method, path with parameters filled in) of every documented operation under ``prefix``."""
    schema = httpx.get(f"{deployment.api.url}/openapi.json").json()
    found = [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, item in schema["paths"].items()
        for method in item
        if path.startswith(prefix) and path not in PUBLIC
    ]
    assert len(found) >= 10, found
    return found


def call(base_url: str, method: str, path: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    body = {} if method in ("POST", "PUT", "PATCH") else None
    return httpx.request(method, base_url + path, json=body, headers=headers, timeout=60)


def revoked_key(deployment: Deployment, tenant: TenantHandle) -> str:
    with deployment.admin() as admin:
        created = admin.post(f"/admin/tenants/{tenant.id}/keys", json={"name": "leaked"}).json()
        assert admin.delete(f"/admin/tenants/{tenant.id}/keys/{created['id']}").status_code == 200
    return created["key"]


@pytest.mark.parametrize("who", ["no-key", "revoked-key", "internal-token", "admin-key"])
def test_tenant_routes_refuse_anything_but_a_live_tenant_key(serving: Deployment, who: str) -> None:
    tenant = serving.make_tenant()
    settings = serving.settings
    assert settings.internal_token is not None and settings.admin_key is not None
    key, expected = {
        "no-key": (None, Refusal(401, "missing API key", code="missing_api_key")),
        "revoked-key": (revoked_key(serving, tenant), Refusal(401, "revoked", code="revoked_api_key")),
        "internal-token": (settings.internal_token.get_secret_value(), Refusal(401, "invalid API key")),
        "admin-key": (settings.admin_key.get_secret_value(), Refusal(401, "admin key only opens /admin routes")),
    }[who]
    with stores_nothing(serving, tenant):
        for method, path in operations(serving, "/v1/"):
            assert_refused(call(serving.api.url, method, path, key), expected)
    assert_still_serving(serving, tenant)


@pytest.mark.parametrize("who", ["no-key", "tenant-key", "internal-token"])
def test_admin_routes_refuse_anything_but_the_admin_key(serving: Deployment, who: str) -> None:
    tenant = serving.make_tenant()
    assert serving.settings.internal_token is not None
    key, status = {
        "no-key": (None, 401),
        "tenant-key": (tenant.key, 403),
        "internal-token": (serving.settings.internal_token.get_secret_value(), 401),
    }[who]
    with serving.admin() as admin:
        tenants_before = admin.get("/admin/tenants", params={"limit": 100}).json()
    for method, path in operations(serving, "/admin"):
        response = call(serving.api.url, method, path, key)
        if path == "/admin":  # the dashboard page answers with its sign-in form (HTML) to anyone else
            assert response.status_code == 401 and "Sign in" in response.text
            continue
        assert response.status_code == status, (method, path, response.text)
        assert response.json()["error"]["type"] in ("authentication_error", "permission_error")
    with serving.admin() as admin:
        assert admin.get("/admin/tenants", params={"limit": 100}).json() == tenants_before


@pytest.mark.parametrize("who", ["no-key", "tenant-key", "admin-key"])
def test_inference_servers_refuse_all_but_the_internal_token(serving: Deployment, who: str) -> None:
    tenant = serving.make_tenant()
    assert serving.settings.admin_key is not None
    key = {"no-key": None, "tenant-key": tenant.key, "admin-key": serving.settings.admin_key.get_secret_value()}[who]
    for replica in serving.replicas.values():
        for method, path in SERVER_ROUTES:
            assert_refused(call(replica.url, method, path, key), Refusal(401, "needs the internal token"))
        assert httpx.get(f"{replica.url}/health").status_code == 200


def test_fields_only_the_api_may_set_get_a_client_nothing(serving: Deployment, peft_adapter_dir: Path) -> None:
    owner, intruder = serving.make_tenant(), serving.make_tenant()
    theirs = upload_adapter(owner, peft_adapter_dir)
    descriptor = {
        "id": theirs["id"],
        "name": theirs["model"],
        "base_model": serving.base_model,
        "storage_prefix": f"tenants/{owner.id}/adapters/{theirs['id']}/",
        "sha256": theirs["sha256"],
        "config_sha256": theirs["sha256"],
        "rank": theirs["rank"],
    }
    spoofed_stats = {"replica": "spoofed", "gpu_seconds": 1e9, "cold_start": True}
    body = {
        "model": serving.base_model,
        "prompt": "hi",
        "max_tokens": 2,
        ADAPTER_FIELD: descriptor,
        STATS_FIELD: spoofed_stats,
    }
    with intruder.http() as http:
        for stream in (False, True):
            answer = http.post("/v1/completions", json={**body, "stream": stream})
            assert answer.status_code == 200, answer.text
            assert STATS_FIELD not in answer.text and theirs["model"] not in answer.text
        named = http.post("/v1/completions", json={**body, "model": theirs["model"]})
        assert_refused(named, Refusal(404, "does not exist or you do not have access to it", "model"))
    records = serving.usage_records(intruder.id)
    assert len(records) == 2  # the refused one was not metered
    for record in records:  # served on the base model, metered by what the replica measured
        assert record.adapter_id is None and record.replica != "spoofed" and record.gpu_seconds < 1e6
        assert not record.cold_start
    assert serving.usage_records(owner.id) == []


def test_a_tenants_rate_limit_holds_under_a_concurrent_burst(serving: Deployment) -> None:
    limited = serving.make_tenant(requests_per_minute=6)  # one request now, the next in ten seconds
    free = serving.make_tenant()
    body = {"model": serving.base_model, "prompt": "hi", "max_tokens": 1}

    def burst(tenant: TenantHandle) -> list[httpx.Response]:
        with tenant.http() as http, ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda _: http.post("/v1/completions", json=body), range(8)))

    limited_answers, free_answers = burst(limited), burst(free)
    assert sorted(r.status_code for r in limited_answers) == [200] + [429] * 7
    for refused in (r for r in limited_answers if r.status_code == 429):
        assert_refused(refused, Refusal(429, "rate limit of 6 requests per minute", code="rate_limit_requests"))
        assert int(refused.headers["retry-after"]) >= 1
    assert [r.status_code for r in free_answers] == [200] * 8
    assert len(serving.usage_records(limited.id)) == 1  # refused requests never reached a replica
