"""KV blocks per sequence: a block table is the list of pages holding its tokens, in order.

With prefix caching, a sequence starting (or resuming after preemption) first takes the cached pages that
already hold a prefix of its tokens under its adapter, and computes only the rest; the pages it fills are
published under their keys as soon as they are scheduled (the step that computes them runs before anyone
could read them), so a sibling of ``n > 1`` or an identical prompt admitted in the same step shares them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.memory.page_keys import chain_root, extend_keys
from server.memory.pool import PagePool, PageUse

if TYPE_CHECKING:
    from server.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Grows and frees block tables out of the shared pool; never touches tensors."""

    def __init__(
        self, pool: PagePool, block_size: int, watermark_pages: int = 0, enable_prefix_caching: bool = False
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.watermark_pages = watermark_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.num_queried_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.num_hit_tokens = 0  # ... and found there

    def pages_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra pages for a table to hold ``num_tokens`` tokens in total."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, *, admitting: bool = False) -> bool:
        """Whether the pages are available now (free or cached); new admissions also leave the watermark."""
        reserve = self.watermark_pages if admitting else 0
        return self.pages_needed(block_table, num_tokens) + reserve <= self.pool.num_available

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append pages so the table holds ``num_tokens`` tokens (raises ``PoolExhausted`` if it cannot)."""
        needed = self.pages_needed(block_table, num_tokens)
        if needed:
            block_table.extend(self.pool.allocate(needed, PageUse.KV))

    def free(self, block_table: list[int]) -> None:
        """Give every page of the table back and empty it; keyed pages stay cached, the last page evicted first."""
        if block_table:
            self.pool.release(block_table[::-1], PageUse.KV)
            block_table.clear()

    # ----- prefix caching ---------------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages holding the longest cached prefix of a sequence with no pages yet; never all of its tokens, so
        the last one is computed and yields logits."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        self._extend_keys(seq, limit)
        pages = []
        for key in seq.page_keys[:limit]:
            page = self.pool.lookup(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int, *, admitting: bool) -> bool:
        """Whether a sequence taking the ``cached`` pages can grow to ``num_tokens`` tokens now."""
        reserve = self.watermark_pages if admitting else 0
        revived = sum(1 for page in cached if self.pool.is_cached(page))  # they leave the available pages
        new = max(0, blocks_for(num_tokens, self.block_size) - len(cached))
        return new + revived + reserve <= self.pool.num_available

    def admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> None:
        """Start a sequence: share the ``cached`` pages (their tokens count as computed), then grow its table to
        hold ``num_tokens`` tokens and publish the pages that this step fills."""
        for page in cached:
            self.pool.share(page)
        seq.block_table.extend(cached)
        hit = len(cached) * self.block_size
        seq.num_computed_tokens = hit
        seq.num_keyed_pages = len(cached)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(hit, seq.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += hit
        self.grow(seq.block_table, num_tokens)
        self.publish(seq, num_tokens)

    def publish(self, seq: Sequence, num_tokens: int) -> None:
        """Key the sequence's pages that are full once its first ``num_tokens`` tokens are computed."""
        if not self.enable_prefix_caching:
            return
        full = num_tokens // self.block_size
        if full <= seq.num_keyed_pages:
            return
        self._extend_keys(seq, full)
        for i in range(seq.num_keyed_pages, full):
            self.pool.publish(seq.block_table[i], seq.page_keys[i], seq.cache_owner)
        seq.num_keyed_pages = full

    def _extend_keys(self, seq: Sequence, num_pages: int) -> None:
        root = chain_root(seq.cache_owner, seq.cache_salt) if not seq.page_keys else b""
        extend_keys(seq.page_keys, root, seq.token_ids, num_pages, self.block_size)
