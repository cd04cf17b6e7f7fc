"""The replica's audit trail keeps events until they are sent, in order, within a bound."""

from __future__ import annotations

import logging

import pytest

from core.descriptor import AdapterDescriptor
from server.adapters.sources import LocalSource, StoreSource, descriptor_key
from server.audit import AuditTrail, audit_event

DESCRIPTOR = AdapterDescriptor(
    id="adapter-1",
    name="ft:tiny:t:x:adapter-1",
    base_model="tiny",
    storage_prefix="tenants/t/adapters/adapter-1/",
    sha256="ab" * 32,
    config_sha256="cd" * 32,
    rank=8,
)


def test_events_name_the_adapter_its_bytes_and_the_cause() -> None:
    stored = audit_event(
        "load", descriptor_key(DESCRIPTOR), StoreSource(DESCRIPTOR), tier="store", reason="request", cause="request:r1"
    )
    assert (stored.adapter_id, stored.adapter_name, stored.sha256) == ("adapter-1", DESCRIPTOR.name, DESCRIPTOR.sha256)
    local = audit_event(
        "refuse", "local:mine#1", LocalSource("mine", "mine", None), tier="local", reason="x", detail="y" * 5000
    )  # type: ignore[arg-type]
    assert (local.adapter_id, local.adapter_name, local.sha256, len(local.detail or "")) == (None, "mine", None, 1000)
    forgotten = audit_event("evict", descriptor_key(DESCRIPTOR), None, tier="host", reason="host_lru")
    assert (forgotten.adapter_id, forgotten.adapter_name) == ("adapter-1", descriptor_key(DESCRIPTOR))


def test_unsent_events_come_back_first_and_the_oldest_go_past_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    trail = AuditTrail("r0", max_unsent=3)
    events = [audit_event("evict", f"adapter-{i}@x", None, tier="pool", reason="idle") for i in range(5)]
    for event in events[:2]:
        trail.record(event)
    taken = trail.take()
    assert [e.adapter_id for e in taken] == ["adapter-0", "adapter-1"] and {e.replica for e in taken} == {"r0"}
    trail.record(events[2])
    trail.give_back(taken[1:])  # adapter-1 could not be sent: it goes back before what came since
    assert [e.adapter_id for e in trail.take()] == ["adapter-1", "adapter-2"]
    for event in events:
        trail.record(event)
    with caplog.at_level(logging.WARNING, logger="server.audit"):
        assert [e.adapter_id for e in trail.take()] == ["adapter-2", "adapter-3", "adapter-4"]
    assert "dropped 2 audit events" in caplog.text
    assert trail.take() == []
