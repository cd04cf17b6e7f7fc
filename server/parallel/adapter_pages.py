"""Adapter pages on rank 0 under tensor parallelism: every rank's slice planned at once, every change relayed.

Rank 0 validates an adapter against the whole model, plans each rank's slice (:meth:`Shard.adapter`) into the same
page layout, and keeps the followers' images in the plan, so the host tier caches all of them together. A
placement or a cleared slot is decided here, on the engine thread, and relayed to the followers before the next
step: the pool's accounting exists once, on rank 0.
"""

from __future__ import annotations

from dataclasses import replace

from core.adapter_format import AdapterWeights, BaseShapes
from loraplex_kernels import LoraTables
from server.memory.adapter_pages import AdapterPages, AdapterPlan, check_shapes, weights_identity
from server.memory.pool import PagePool
from server.parallel.followers import Followers
from server.parallel.shards import Shard


class ShardedAdapterPages(AdapterPages):
    """:class:`AdapterPages` of rank 0 whose followers hold the other slices of every adapter."""

    def __init__(
        self, pool: PagePool, tables: LoraTables, shapes: BaseShapes, whole: BaseShapes, followers: Followers
    ) -> None:
        super().__init__(pool, tables, shapes)
        self.whole = whole  # what adapters are checked against; ``shapes`` is one rank's slice of it
        self.followers = followers

    def plan(self, name: str, weights: AdapterWeights, identity: bytes | None = None) -> AdapterPlan:
        check_shapes(weights, self.whole)
        identity = identity or weights_identity(weights)
        world = self.followers.tp.world
        plan_one = super().plan
        plans = [plan_one(name, Shard(r, world).adapter(weights), identity) for r in range(world)]
        return replace(plans[0], rank_images=tuple(p.image for p in plans[1:]))

    def write(self, plan: AdapterPlan) -> tuple[int, list[int]]:
        slot, pages = super().write(plan)
        self.followers.placed(plan, slot, pages)
        return slot, pages

    def clear(self, slot: int, pages: list[int]) -> None:
        super().clear(slot, pages)
        self.followers.cleared(slot)
