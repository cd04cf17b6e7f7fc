"""The engine's resident adapters: slot and pages of each, and how many unfinished requests hold it.

The one owner of residency and of the reference count. The tier manager asks it whether an adapter is
resident, how many pages it holds and whether a request uses it; nobody keeps a copy of those facts.
A request takes its reference when the engine accepts it and gives it back when the engine reports it
finished, so an adapter with a reference is never removed (``AdapterInUse``), and removing one without
references always succeeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from core.adapter_format import AdapterWeights
from server.engine.errors import AdapterAlreadyLoaded, AdapterInUse, AdapterNotLoaded
from server.memory.adapter_pages import AdapterPages, AdapterPlan


@dataclass(frozen=True)
class ResidentAdapter:
    """An adapter in pool pages, published in ``slot`` of the LoRA tables."""

    name: str
    slot: int
    pages: tuple[int, ...]
    max_rank: int
    ranks: dict[tuple[int, str], int] = field(default_factory=dict)
    identity: bytes = b""  # content digest of its weights: the key chain root of its cached KV pages

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class ResidentAdapters:
    """Resident adapters by name, their slots and pages, and one reference count per adapter."""

    def __init__(self, pages: AdapterPages) -> None:
        self._pages = pages
        self._resident: dict[str, ResidentAdapter] = {}
        self._refs: dict[str, int] = {}  # only resident adapters with at least one reference

    # ----- residency ------------------------------------------------------------------------------------

    @property
    def resident(self) -> Mapping[str, ResidentAdapter]:
        """A read-only view (not a copy) of the resident adapters."""
        return MappingProxyType(self._resident)

    @property
    def pages(self) -> AdapterPages:
        """Where the adapters' rows are (a tensor-parallel follower writes through it what rank 0 placed)."""
        return self._pages

    @property
    def slot_max_rank(self) -> list[int]:
        """Each slot's widest rank, kept on the host for per-step metadata (0: free slot)."""
        return self._pages.slot_max_rank

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def get(self, name: str) -> ResidentAdapter | None:
        return self._resident.get(name)

    def plan(self, name: str, weights: AdapterWeights, identity: bytes | None = None) -> AdapterPlan:
        """Validate ``weights`` and work out their pages; :meth:`place` places exactly this plan."""
        return self._pages.plan(name, weights, identity)

    def place(self, name: str, plan: AdapterPlan) -> ResidentAdapter:
        """Make ``name`` resident as planned. Raises when it already is, or pages or slots run out."""
        if name in self._resident:
            raise AdapterAlreadyLoaded(f"adapter {name!r} is already loaded", param="lora_name")
        slot, pages = self._pages.write(plan)
        adapter = ResidentAdapter(name, slot, tuple(pages), plan.max_rank, plan.module_ranks, plan.identity)
        self._resident[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        """Give a resident adapter's pages and slot back, and the cached KV pages computed under it (unless
        another resident adapter has the same weights); refused while a request holds it."""
        adapter = self._resident.get(name)
        if adapter is None:
            raise AdapterNotLoaded(f"adapter {name!r} is not loaded", param="lora_name")
        if self._refs.get(name):
            raise AdapterInUse(f"{self._refs[name]} unfinished requests use adapter {name!r}")
        del self._resident[name]
        self._pages.clear(adapter.slot, list(adapter.pages))
        if not any(other.identity == adapter.identity for other in self._resident.values()):
            self._pages.pool.drop_owner(adapter.identity)

    # ----- references -------------------------------------------------------------------------------------

    def acquire(self, name: str) -> ResidentAdapter:
        """A request starts using ``name``, which must be resident; it stays resident until :meth:`release`."""
        adapter = self._resident.get(name)
        if adapter is None:
            raise AdapterNotLoaded(f"adapter {name!r} is not loaded", param="model")
        self._refs[name] = self._refs.get(name, 0) + 1
        return adapter

    def release(self, name: str) -> None:
        """A request that used ``name`` has finished."""
        count = self._refs.get(name, 0)
        if count < 1:
            raise RuntimeError(f"adapter {name!r} released more often than acquired")
        if count == 1:
            del self._refs[name]
        else:
            self._refs[name] = count - 1

    def refs(self, name: str) -> int:
        """Unfinished requests that hold ``name``."""
        return self._refs.get(name, 0)

    def in_use(self, name: str) -> bool:
        return name in self._refs
