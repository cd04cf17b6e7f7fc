"""The unified paged pool: one arena, one free list, pages lent to KV blocks or adapter rows."""

from __future__ import annotations

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
    """Exact page accounting, for metrics and eviction decisions."""

    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    page_bytes: int

    @property
    def kv_capacity_pages(self) -> int:
        """Pages the KV cache could use if every running sequence finished: all but adapter pages."""
        return self.total_pages - self.adapter_pages


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
        self._use: dict[int, PageUse] = {}
        self._counts = {PageUse.KV: 0, PageUse.ADAPTER: 0}

    @staticmethod
    def pages_for_bytes(pool_bytes: int, geometry: KVGeometry, dtype: torch.dtype) -> int:
        """How many whole pages fit in a byte budget."""
        return pool_bytes // (geometry.page_elems * torch.empty((), dtype=dtype).element_size())

    @property
    def num_pages(self) -> int:
        return self.arena.numel() // self.page_elems

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int, use: PageUse) -> list[int]:
        """Take ``count`` pages for ``use``; all or nothing."""
        if count > len(self._free):
            raise PoolExhausted(
                f"{count} pages needed, {len(self._free)} free of {self.num_pages}: "
                "unload an adapter or wait for running requests to finish"
            )
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._use[page] = use
        self._counts[use] += count
        return pages

    def release(self, pages: list[int], use: PageUse) -> None:
        """Return pages taken for ``use`` to the free list."""
        for page in pages:
            if self._use.get(page) is not use:
                raise ValueError(f"page {page} is not held as {use.value}")
            del self._use[page]
        self._counts[use] -= len(pages)
        self._free.extend(reversed(pages))

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
        )
