"""The unified paged pool: one arena, pages lent to KV blocks or adapter rows, and the prefix cache's pages.

Every page is exactly one of: free; KV in use (held by ``refs`` block tables); KV cached (a full page of a
finished or preempted sequence, held by nobody, findable by its key, evictable); adapter rows. A page's key
names the tokens and adapter it holds (:mod:`server.memory.page_keys`), so another sequence with the same
prefix under the same adapter can share it instead of recomputing it.

One reclaim order for every allocation: free pages first, then cached KV pages, least recently used first.
Idle adapters come last, evicted by the tier manager, which counts cached pages as available
(see docs/prefix-caching.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

import torch

from core.errors import ServiceUnavailable
from loraplex_kernels import KVGeometry


class PoolExhausted(ServiceUnavailable):
    """Not enough free pages; evict an adapter or wait for requests to finish."""

    default_code = "pool_exhausted"


class PageUse(Enum):
    KV = "kv"
    ADAPTER = "adapter"


@dataclass(frozen=True)
class PoolStats:
    """Exact page accounting, for metrics and eviction decisions: free + kv + kv_cached + adapter = total."""

    total_pages: int
    free_pages: int
    kv_pages: int  # KV pages some sequence holds
    adapter_pages: int
    page_bytes: int
    kv_cached_pages: int = 0  # KV pages only the prefix cache holds: evictable, reclaimed before adapters

    @property
    def kv_capacity_pages(self) -> int:
        """Pages the KV cache could use if every running sequence finished: all but adapter pages."""
        return self.total_pages - self.adapter_pages

    @property
    def available_pages(self) -> int:
        """Pages an allocation can take now: free ones and cached KV pages."""
        return self.free_pages + self.kv_cached_pages


class PagePool:
    """A flat arena of ``num_pages`` interchangeable pages (see :mod:`loraplex_kernels.layout`)."""

    def __init__(self, geometry: KVGeometry, num_pages: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_pages < 1:
            raise ValueError("the pool needs at least one page")
        self.geometry = geometry
        self.page_elems = geometry.page_elems
        self.arena = torch.zeros(num_pages * self.page_elems, dtype=dtype, device=device)
        # A stack: the most recently freed page is reused first (it is likely still in cache).
        self._free = list(range(num_pages - 1, -1, -1))
        self._use: dict[int, PageUse] = {}  # pages in use: KV (with refs) or adapter
        self._counts = {PageUse.KV: 0, PageUse.ADAPTER: 0}
        self._refs: dict[int, int] = {}  # KV page in use -> block tables holding it
        self._cached: OrderedDict[int, None] = OrderedDict()  # unheld keyed KV pages, least recently used first
        self._key_of: dict[int, tuple[bytes, bytes]] = {}  # keyed page -> (key, owner)
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._owned: dict[bytes, set[int]] = {}  # owner (adapter identity) -> keyed pages

    @staticmethod
    def pages_for_bytes(pool_bytes: int, geometry: KVGeometry, dtype: torch.dtype) -> int:
        """How many whole pages fit in a byte budget."""
        return pool_bytes // (geometry.page_elems * torch.empty((), dtype=dtype).element_size())

    @property
    def num_pages(self) -> int:
        return self.arena.numel() // self.page_elems

    @property
    def num_free(self) -> int:
        """Pages on the free list (cached KV pages not counted: see :attr:`num_available`)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Pages an allocation can take: free ones plus cached KV pages (evicted on demand)."""
        return len(self._free) + len(self._cached)

    def allocate(self, count: int, use: PageUse) -> list[int]:
        """Take ``count`` pages for ``use``, evicting least recently used cached KV pages if the free list is
        short; all or nothing. KV pages come with one reference."""
        if count > self.num_available:
            raise PoolExhausted(
                f"{count} pages needed, {self.num_available} free or cached of {self.num_pages}: "
                "unload an adapter or wait for running requests to finish"
            )
        while len(self._free) < count:
            page, _ = self._cached.popitem(last=False)
            self._unkey(page)
            self._free.append(page)
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._use[page] = use
            if use is PageUse.KV:
                self._refs[page] = 1
        self._counts[use] += count
        return pages

    def release(self, pages: list[int], use: PageUse) -> None:
        """Give back one hold on each page. An adapter page is freed; a KV page whose last hold this is stays
        cached when it has a key, else is freed. Pages released earlier are evicted earlier."""
        for page in pages:
            if self._use.get(page) is not use:
                raise ValueError(f"page {page} is not held as {use.value}")
        if use is PageUse.ADAPTER:
            for page in pages:
                del self._use[page]
            self._counts[use] -= len(pages)
            self._free.extend(reversed(pages))
            return
        for page in pages:
            refs = self._refs[page] - 1
            if refs:
                self._refs[page] = refs
                continue
            del self._refs[page], self._use[page]
            self._counts[use] -= 1
            if page in self._key_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    # ----- prefix cache -----------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> int | None:
        """The page holding ``key``'s tokens (in use or cached), if any."""
        return self._page_of.get(key)

    def refs(self, page: int) -> int:
        """Block tables holding a KV page (0 for a cached, free or adapter page)."""
        return self._refs.get(page, 0)

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def share(self, page: int) -> None:
        """Take one more hold on a keyed KV page found by :meth:`lookup` (a cached one comes back into use)."""
        if page in self._cached:
            del self._cached[page]
            self._use[page] = PageUse.KV
            self._refs[page] = 1
            self._counts[PageUse.KV] += 1
        elif page in self._key_of and page in self._refs:
            self._refs[page] += 1
        else:
            raise ValueError(f"page {page} holds no cached KV")

    def publish(self, page: int, key: bytes, owner: bytes) -> bool:
        """Name a full KV page in use by its ``key``; ``owner`` is the adapter identity it was computed under.
        False (nothing changes) when the page already has a key or another page holds the same tokens."""
        if self._use.get(page) is not PageUse.KV:
            raise ValueError(f"page {page} is not a KV page in use")
        if page in self._key_of or key in self._page_of:
            return False
        self._key_of[page] = (key, owner)
        self._page_of[key] = page
        self._owned.setdefault(owner, set()).add(page)
        return True

    def drop_owner(self, owner: bytes) -> int:
        """Forget every page computed under ``owner`` (an adapter leaving the pool): cached ones are freed, ones
        in use lose their key. Returns the pages freed."""
        freed = 0
        for page in list(self._owned.get(owner, ())):
            self._unkey(page)
            if page in self._cached:
                del self._cached[page]
                self._free.append(page)
                freed += 1
        return freed

    def flush_cache(self) -> int:
        """Forget every key; cached pages become free. Returns the pages freed."""
        freed = len(self._cached)
        self._free.extend(self._cached)
        self._cached.clear()
        self._key_of.clear()
        self._page_of.clear()
        self._owned.clear()
        return freed

    def _unkey(self, page: int) -> None:
        key, owner = self._key_of.pop(page)
        del self._page_of[key]
        owned = self._owned[owner]
        owned.discard(page)
        if not owned:
            del self._owned[owner]

    # ----- views ------------------------------------------------------------------------------------------

    def page_view(self, page: int) -> torch.Tensor:
        """The flat elements of one page (a view into the arena)."""
        start = page * self.page_elems
        return self.arena[start : start + self.page_elems]

    def stats(self) -> PoolStats:
        return PoolStats(
            total_pages=self.num_pages,
            free_pages=len(self._free),
            kv_pages=self._counts[PageUse.KV],
            adapter_pages=self._counts[PageUse.ADAPTER],
            page_bytes=self.page_elems * self.arena.element_size(),
            kv_cached_pages=len(self._cached),
        )
