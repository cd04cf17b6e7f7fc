"""Routing decisions: an adapter sticks to one replica, only a leaving replica's adapters move, overloaded
or busy replicas spill over to the least-loaded one, and refusing replicas are tried last."""

from __future__ import annotations

from collections import Counter

from api.routing.marks import ReplicaMarks
from api.routing.plan import plan_route, rendezvous_order
from core.protocol import PoolPages, ReplicaStatus

ADAPTERS = [f"adapter-{i:03d}" for i in range(200)]


def replica(
    rid: str, *, running: int = 0, waiting: int = 0, max_waiting: int = 8, resident: tuple = ()
) -> ReplicaStatus:
    return ReplicaStatus(
        id=rid,
        url=f"http://{rid}:8001",
        base_model="tiny",
        started_at=0.0,
        updated_at=0.0,
        running=running,
        waiting=waiting,
        max_waiting=max_waiting,
        pool=PoolPages(total=100, kv=10, adapter=10, free=80, page_bytes=4096),
        resident_adapters=list(resident),
    )


def first(replicas: list[ReplicaStatus], adapter: str | None, marks: ReplicaMarks | None = None, **load: int) -> str:
    return plan_route(replicas, adapter, marks or ReplicaMarks(), Counter(load), now=100.0)[0].id


def test_an_adapter_always_goes_to_the_same_replica_whatever_the_listing_order() -> None:
    replicas = [replica(r) for r in ("a", "b", "c")]
    for adapter in ADAPTERS:
        assert first(replicas, adapter) == first(list(reversed(replicas)), adapter)


def test_adapters_spread_over_replicas() -> None:
    replicas = [replica(r) for r in ("a", "b", "c")]
    counts = Counter(first(replicas, adapter) for adapter in ADAPTERS)
    assert set(counts) == {"a", "b", "c"}
    assert min(counts.values()) > len(ADAPTERS) / 6  # no replica is starved (expected 1/3 each)


def test_only_the_adapters_of_a_leaving_replica_move() -> None:
    before = {a: first([replica(r) for r in ("a", "b", "c")], a) for a in ADAPTERS}
    after = {a: first([replica(r) for r in ("a", "c")], a) for a in ADAPTERS}
    moved = {a for a in ADAPTERS if before[a] != after[a]}
    assert moved == {a for a in ADAPTERS if before[a] == "b"}


def test_the_fallback_replica_is_where_the_adapter_goes_when_its_own_leaves() -> None:
    replicas = [replica(r) for r in ("a", "b", "c")]
    for adapter in ADAPTERS[:50]:
        order = [r.id for r in plan_route(replicas, adapter, ReplicaMarks(), Counter(), now=0.0)]
        assert order[1] == first([r for r in replicas if r.id != order[0]], adapter)


def test_an_overloaded_replica_spills_over_to_the_least_loaded_one() -> None:
    adapter = ADAPTERS[0]
    home = first([replica(r) for r in ("a", "b", "c")], adapter)
    others = sorted({"a", "b", "c"} - {home})
    replicas = [
        replica(home, waiting=6),  # 6 of 8 waiting slots: overloaded
        replica(others[0], running=5),
        replica(others[1], running=1),
    ]
    order = [r.id for r in plan_route(replicas, adapter, ReplicaMarks(), Counter(), now=0.0)]
    assert order == [others[1], others[0], home]


def test_spill_over_prefers_a_replica_that_already_holds_the_adapter() -> None:
    adapter = ADAPTERS[1]
    home = first([replica(r) for r in ("a", "b", "c")], adapter)
    others = sorted({"a", "b", "c"} - {home})
    replicas = [replica(home, waiting=8), replica(others[0], running=4, resident=(adapter,)), replica(others[1])]
    assert first(replicas, adapter) == others[0]


def test_a_replica_that_answered_429_is_avoided_until_its_mark_expires() -> None:
    adapter = ADAPTERS[2]
    replicas = [replica(r) for r in ("a", "b")]
    home = first(replicas, adapter)
    marks = ReplicaMarks()
    marks.mark_busy(home, until=105.0)
    assert first(replicas, adapter, marks) != home
    marks.forget_expired(106.0)
    assert first(replicas, adapter, marks) == home


def test_when_every_replica_is_busy_the_adapter_stays_home() -> None:
    adapter = ADAPTERS[3]
    home = first([replica(r) for r in ("a", "b")], adapter)
    replicas = [replica(r, waiting=8) for r in ("a", "b")]
    assert first(replicas, adapter) == home


def test_unreachable_replicas_come_last_but_are_still_listed() -> None:
    adapter = ADAPTERS[4]
    replicas = [replica(r) for r in ("a", "b", "c")]
    home = first(replicas, adapter)
    marks = ReplicaMarks()
    marks.mark_unreachable(home, until=200.0)
    order = [r.id for r in plan_route(replicas, adapter, marks, Counter(), now=100.0)]
    assert order[-1] == home and len(order) == 3


def test_base_model_requests_go_to_the_least_loaded_replica_counting_our_in_flight_requests() -> None:
    replicas = [replica("a", running=2), replica("b", running=1), replica("c", running=1)]
    assert first(replicas, None) == "b"
    assert first(replicas, None, b=3) == "c"  # b has 3 more in flight from this process: 4 vs c's 1


def test_rendezvous_order_is_a_permutation() -> None:
    replicas = [replica(r) for r in "abcdef"]
    assert sorted(r.id for r in rendezvous_order("x", replicas)) == list("abcdef")
