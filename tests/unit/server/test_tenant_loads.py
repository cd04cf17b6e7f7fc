"""Per-tenant loads in metrics and heartbeats keep a bounded label set: the busiest by name, the rest summed."""

from __future__ import annotations

from server.engine.tenancy import TenantLoad
from server.runtime import busiest_tenants


def test_the_busiest_tenants_are_named_and_the_rest_add_up_as_other() -> None:
    loads = {f"t{i}": TenantLoad(waiting=i, running=1, kv_pages=2 * i) for i in range(20)}
    loads[""] = TenantLoad(running=100, kv_pages=3)
    shown = busiest_tenants(loads, limit=4)
    assert list(shown) == ["direct", "t19", "t18", "t17", "other"]
    rest = shown["other"]
    assert (rest.waiting, rest.running, rest.kv_pages) == (sum(range(17)), 17, 2 * sum(range(17)))
    assert busiest_tenants({"a": TenantLoad(running=1)}, limit=4).keys() == {"a"}
