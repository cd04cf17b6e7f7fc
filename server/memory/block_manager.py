"""KV blocks per sequence: a block table is the list of pages holding its tokens, in order."""

from __future__ import annotations

from server.memory.pool import PagePool, PageUse


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Grows and frees block tables out of the shared pool; never touches tensors."""

    def __init__(self, pool: PagePool, block_size: int, watermark_pages: int = 0) -> None:
        self.pool = pool
        self.block_size = block_size
        self.watermark_pages = watermark_pages

    def pages_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra pages for a table to hold ``num_tokens`` tokens in total."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, *, admitting: bool = False) -> bool:
        """Whether the pages are free now; new admissions also leave the watermark free to limit thrashing."""
        reserve = self.watermark_pages if admitting else 0
        return self.pages_needed(block_table, num_tokens) + reserve <= self.pool.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append pages so the table holds ``num_tokens`` tokens (raises ``PoolExhausted`` if it cannot)."""
        needed = self.pages_needed(block_table, num_tokens)
        if needed:
            block_table.extend(self.pool.allocate(needed, PageUse.KV))

    def free(self, block_table: list[int]) -> None:
        """Give every page of the table back and empty it."""
        if block_table:
            self.pool.release(block_table, PageUse.KV)
            block_table.clear()
