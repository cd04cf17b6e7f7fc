"""Adapter-affinity routing over two real replicas: an adapter's requests all go to its rendezvous replica,
a finished job's adapter is prefetched there, and a deleted adapter leaves every replica."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.routing.plan import rendezvous_order
from core import db
from core.models import Adapter
from tests.integration.api_inference.deployment import Deployment
from tests.integration.api_inference.serving import upload_adapter
from worker.announce import announce_prefetch

pytestmark = pytest.mark.slow


def home_of(serving: Deployment, adapter_id: str) -> str:
    return rendezvous_order(adapter_id, serving.heartbeats().values())[0].id


def test_an_announced_adapter_is_prefetched_into_the_pool_of_its_own_replica_only(
    serving: Deployment, peft_adapter_dir: Path
) -> None:
    tenant = serving.make_tenant()
    adapter_id = upload_adapter(tenant, peft_adapter_dir)["id"]
    with db.read_session(serving.engine) as session:
        row = session.get(Adapter, adapter_id)
    assert row is not None

    row.job_id = "ftjob-that-trained-it"  # not stored: the announcement names the job behind the prefetch
    assert announce_prefetch(serving.settings, row)  # what the worker does when a job succeeds

    home = home_of(serving, adapter_id)
    serving.wait_until(
        lambda: adapter_id in serving.heartbeats()[home].resident_adapters,
        f"{adapter_id} to be resident on {home}",
        timeout=60,
    )
    others = [s for rid, s in serving.heartbeats().items() if rid != home]
    assert others and all(adapter_id not in s.resident_adapters for s in others)
    assert serving.usage_records(tenant.id) == []  # no request brought it there

    def loaded(events: list[dict]) -> bool:
        return any(e["action"] == "load" for e in events)

    events = serving.wait_for_audit("the prefetch to be audited", loaded, adapter_id=adapter_id)
    events.sort(key=lambda e: e["at"])
    assert [(e["action"], e["tier"], e["reason"], e["replica"]) for e in events] == [
        ("verify", "store", "ok", home),
        ("load", "store", "prefetch", home),
    ]
    assert {(e["cause"], e["tenant_id"], e["sha256"]) for e in events} == {
        ("job:ftjob-that-trained-it", tenant.id, row.sha256)
    }


def test_every_request_for_an_adapter_goes_to_one_replica(serving: Deployment, peft_adapter_dir: Path) -> None:
    tenant = serving.make_tenant()
    adapters = [upload_adapter(tenant, peft_adapter_dir) for _ in range(4)]
    client = tenant.openai()
    for adapter in adapters:
        for stream in (False, True, False):
            out = client.completions.create(model=adapter["model"], prompt="hi", max_tokens=3, stream=stream)
            if stream:
                list(out)  # type: ignore[arg-type]

    serving.wait_until(lambda: len(serving.usage_records(tenant.id)) == 12, "all requests to be metered")
    served_by: dict[str, set[str | None]] = {}
    for record in serving.usage_records(tenant.id):
        served_by.setdefault(record.adapter_id or "", set()).add(record.replica)
    assert served_by == {a["id"]: {home_of(serving, a["id"])} for a in adapters}
    first_uses = {}
    for record in serving.usage_records(tenant.id):  # in id order: each adapter's first request comes first
        first_uses.setdefault(record.adapter_id, record)
    assert all(record.cold_start for record in first_uses.values())

    # Each adapter was loaded once, on its home replica, by its first request (the id the API gave it).
    events = serving.wait_for_audit(
        "the loads to be audited", lambda es: sum(e["action"] == "load" for e in es) == 4, tenant_id=tenant.id
    )
    loads = {e["adapter_id"]: e for e in events if e["action"] == "load"}
    assert {a: (e["replica"], e["cause"]) for a, e in loads.items()} == {
        a["id"]: (home_of(serving, a["id"]), f"request:{first_uses[a['id']].request_id}") for a in adapters
    }


def test_a_deleted_adapter_leaves_every_replica(serving: Deployment, peft_adapter_dir: Path) -> None:
    tenant = serving.make_tenant()
    adapter = upload_adapter(tenant, peft_adapter_dir)
    tenant.openai().completions.create(model=adapter["model"], prompt="hi", max_tokens=2)
    home = home_of(serving, adapter["id"])
    serving.wait_until(lambda: adapter["id"] in serving.heartbeats()[home].resident_adapters, "the adapter to load")

    tenant.openai().models.delete(adapter["model"])

    def gone() -> bool:
        return all(adapter["id"] not in (*s.resident_adapters, *s.host_adapters) for s in serving.heartbeats().values())

    serving.wait_until(gone, "the deleted adapter to be unloaded everywhere", timeout=60)

    def unloaded(events: list[dict]) -> bool:
        return sum(e["action"] == "evict" for e in events) == 2  # from host RAM and from the pool

    events = serving.wait_for_audit("the unload to be audited", unloaded, adapter_id=adapter["id"])
    # Stored in the order they reached the API (replicas send theirs each heartbeat): read in the order they happened.
    steps = [
        (e["action"], e["tier"], e["reason"], e["replica"], e["cause"]) for e in sorted(events, key=lambda e: e["at"])
    ]
    request, deleted_by = steps[0][4], f"tenant:{tenant.id}"
    assert request is not None and request.startswith("request:")
    assert steps == [
        ("verify", "store", "ok", home, request),
        ("load", "store", "request", home, request),
        ("delete", "store", "deleted", None, deleted_by),
        ("evict", "host", "unload", home, deleted_by),
        ("evict", "pool", "unload", home, deleted_by),
    ]

    with tenant.http() as http:  # the trail is the admins' alone
        assert http.get("/admin/audit").status_code == 403
