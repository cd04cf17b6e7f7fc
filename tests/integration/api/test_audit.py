"""``/admin/audit``: replicas' events (from the audit stream) and the control plane's deletions, attributed to the
adapter's tenant, filtered and paged; the admin's alone."""

from __future__ import annotations

import time

import httpx
import redis

from core.protocol import AUDIT_STREAM, AdapterAuditEvent
from core.settings import Settings
from tests.integration.api.conftest import PeftAdapters, TenantHandle
from tests.integration.api.peft_adapters import adapter_files


def _upload(tenant: TenantHandle, peft_adapters: PeftAdapters) -> dict:
    with tenant.http() as http:
        response = http.post("/v1/adapters", files=adapter_files(peft_adapters.good))
    assert response.status_code == 200, response.text
    return response.json()


def _event(action: str, adapter: dict | None, at: float, replica: str, **facts: str) -> AdapterAuditEvent:
    return AdapterAuditEvent(
        action=action,  # type: ignore[arg-type]
        adapter_id=adapter["id"] if adapter else None,
        adapter_name=adapter["model"] if adapter else "local-one",
        sha256=adapter["sha256"] if adapter else None,
        tier=facts.pop("tier", "store"),
        reason=facts.pop("reason", "request"),
        at=at,
        replica=replica,
        **facts,
    )


def _audit(admin: httpx.Client, **params: object) -> dict:
    response = admin.get("/admin/audit", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def test_replica_events_and_deletions_are_filtered_and_paged(
    admin: httpx.Client,
    tenant: TenantHandle,
    other_tenant: TenantHandle,
    peft_adapters: PeftAdapters,
    api_settings: Settings,
) -> None:
    mine, theirs = _upload(tenant, peft_adapters), _upload(other_tenant, peft_adapters)
    t0 = time.time()
    events = [
        _event("verify", mine, t0, "r-a", reason="ok"),
        _event("load", mine, t0 + 1, "r-a", cause="request:req-1"),
        _event("load", theirs, t0 + 2, "r-b", cause="job:ftjob-7", reason="prefetch"),
        _event("evict", mine, t0 + 3, "r-a", tier="pool", reason="idle"),
        _event("refuse", None, t0 + 4, "r-b", tier="local", reason="base_model_mismatch", detail="made on another"),
    ]
    client = redis.Redis.from_url(api_settings.redis_url or "")
    with client:
        for event in events:
            client.xadd(AUDIT_STREAM, {"event": event.model_dump_json()})
        client.xadd(AUDIT_STREAM, {"event": b"{not json"})  # skipped, and the rest still stored
    with tenant.http() as http:
        assert http.delete(f"/v1/adapters/{mine['id']}").status_code == 200

    deadline = time.monotonic() + 30
    while len(_audit(admin, tenant_id=tenant.id)["data"]) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    ours = _audit(admin, tenant_id=tenant.id)["data"]
    assert sorted((e["action"], e["replica"]) for e in ours) == [
        ("delete", None),
        ("evict", "r-a"),
        ("load", "r-a"),
        ("verify", "r-a"),
    ]
    [deleted] = [e for e in ours if e["action"] == "delete"]
    assert (deleted["adapter_id"], deleted["sha256"], deleted["cause"]) == (
        mine["id"],
        mine["sha256"],
        f"tenant:{tenant.id}",
    )
    assert deleted["adapter_name"] == mine["model"] and deleted["object"] == "audit.event"

    theirs_only = _audit(admin, adapter_id=theirs["id"])["data"]
    assert [(e["tenant_id"], e["cause"], e["reason"]) for e in theirs_only] == [
        (other_tenant.id, "job:ftjob-7", "prefetch")
    ]
    assert [e["cause"] for e in _audit(admin, cause="request:req-1")["data"]] == ["request:req-1"]
    local = [e for e in _audit(admin, replica="r-b", action="refuse")["data"] if e["at"] >= t0]
    assert [(e["tenant_id"], e["adapter_id"], e["detail"]) for e in local] == [(None, None, "made on another")]
    window = _audit(admin, tenant_id=tenant.id, since=t0 + 1, until=t0 + 3.5)["data"]
    assert sorted(e["action"] for e in window) == ["evict", "load"]

    # Pages of two, newest first, cover the tenant's four events once each.
    first = _audit(admin, tenant_id=tenant.id, limit=2)
    second = _audit(admin, tenant_id=tenant.id, limit=2, after=first["last_id"])
    assert first["has_more"] and not second["has_more"]
    assert [e["id"] for e in first["data"] + second["data"]] == [e["id"] for e in ours]
    assert [e["id"] for e in ours] == sorted((e["id"] for e in ours), reverse=True)


def test_the_audit_is_for_admins_only(tenant: TenantHandle, admin: httpx.Client) -> None:
    with tenant.http() as http:
        assert http.get("/admin/audit").status_code == 403
    bad = admin.get("/admin/audit", params={"action": "explode"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "action"
