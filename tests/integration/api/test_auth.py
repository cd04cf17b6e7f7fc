"""Keys and the admin API: who gets in where, and what the SDK sees when they do not."""

from __future__ import annotations

import httpx
import openai
import pytest

from core.settings import Settings
from tests.integration.api.conftest import TenantHandle


def test_a_missing_or_unknown_key_is_an_authentication_error(api_server_url: str) -> None:
    with pytest.raises(openai.AuthenticationError) as unknown:
        openai.OpenAI(base_url=f"{api_server_url}/v1", api_key="lpx-not-a-real-key", max_retries=0).models.list()
    missing = httpx.get(f"{api_server_url}/v1/models")

    assert unknown.value.status_code == 401
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    assert missing.json()["error"]["type"] == "authentication_error"


def test_a_revoked_key_stops_working_and_another_key_still_works(admin: httpx.Client, tenant: TenantHandle) -> None:
    created = admin.post(f"/admin/tenants/{tenant.id}/keys", json={"name": "ci"})
    assert created.status_code == 201
    second = TenantHandle(tenant.id, tenant.name, created.json()["key"], tenant.base_url)
    assert [m.id for m in second.openai().models.list()]  # the new key works

    revoked = admin.delete(f"/admin/tenants/{tenant.id}/keys/{created.json()['id']}")

    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError) as caught:
        second.openai().models.list()
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "revoked_api_key"
    assert tenant.openai().models.list().data  # the first key is untouched
    keys = admin.get(f"/admin/tenants/{tenant.name}/keys").json()["data"]
    assert {k["name"]: k["revoked_at"] is not None for k in keys} == {"default": False, "ci": True}
    assert all("key" not in k for k in keys)  # secrets are shown only at creation


def test_a_tenant_key_on_admin_routes_is_forbidden(tenant: TenantHandle) -> None:
    with tenant.http() as http:
        response = http.get("/admin/tenants")

    assert response.status_code == 403
    assert "tenant API keys cannot use admin routes" in response.json()["error"]["message"]


def test_the_admin_key_opens_no_tenant_routes(api_server_url: str, api_settings: Settings) -> None:
    assert api_settings.admin_key is not None
    client = openai.OpenAI(
        base_url=f"{api_server_url}/v1", api_key=api_settings.admin_key.get_secret_value(), max_retries=0
    )

    with pytest.raises(openai.AuthenticationError) as caught:
        client.files.list()

    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "admin_key"


def test_admin_routes_without_a_key_or_with_a_wrong_one_are_401(api_server_url: str) -> None:
    missing = httpx.get(f"{api_server_url}/admin/tenants")
    wrong = httpx.get(f"{api_server_url}/admin/tenants", headers={"Authorization": "Bearer nope"})

    assert (missing.status_code, wrong.status_code) == (401, 401)


def test_a_disabled_tenant_is_refused_until_enabled(admin: httpx.Client, tenant: TenantHandle) -> None:
    client = tenant.openai()

    assert admin.post(f"/admin/tenants/{tenant.id}/disable").json()["disabled"] is True
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.models.list()
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "tenant_disabled"

    assert admin.post(f"/admin/tenants/{tenant.id}/enable").json()["disabled"] is False
    assert client.models.list().data


def test_tenants_are_created_once_and_listed(admin: httpx.Client, tenant: TenantHandle) -> None:
    again = admin.post("/admin/tenants", json={"name": tenant.name})
    invalid = admin.post("/admin/tenants", json={"name": "Not Valid!"})
    listed = admin.get("/admin/tenants", params={"limit": 100}).json()

    assert again.status_code == 409 and again.headers["x-should-retry"] == "false"
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "name"
    assert tenant.id in {t["id"] for t in listed["data"]}
    assert admin.get(f"/admin/tenants/{tenant.name}").json()["id"] == tenant.id
    assert admin.get("/admin/tenants/no-such-tenant").status_code == 404


def test_a_tenants_limits_and_scheduling_weight_are_set_by_admins_only(
    admin: httpx.Client, tenant: TenantHandle
) -> None:
    path = f"/admin/tenants/{tenant.id}/limits"
    default = admin.get(path).json()
    assert default["scheduling_weight"] is None and default["effective_scheduling_weight"] == 1.0
    update = {"requests_per_minute": 120, "tokens_per_minute": None, "scheduling_weight": 2.5}
    set_ = admin.put(path, json=update).json()
    assert (set_["scheduling_weight"], set_["effective_scheduling_weight"]) == (2.5, 2.5)
    assert set_["requests_per_minute"] == 120
    assert admin.get(path).json() == set_
    bad = admin.put(path, json={**update, "scheduling_weight": 0})
    assert bad.status_code == 400 and "scheduling_weight" in bad.text
    with tenant.http() as http:
        assert http.put(path, json={**update, "scheduling_weight": 1000}).status_code == 403
    assert admin.get(path).json()["scheduling_weight"] == 2.5
