"""The paged memory layout shared by the pool (`server/memory`) and the kernels.

One arena per device: a flat tensor of ``num_pages * page_elems`` elements in the model dtype.
Every page is interchangeable, so KV-cache blocks and adapter weights come out of one free list.

KV cache
    One KV block (``block_size`` tokens, every layer, K and V) is exactly one page. Seen through
    :func:`kv_cache_views`, page ``p`` of layer ``l`` is ``k[p]`` / ``v[p]`` with shape
    ``[block_size, num_kv_heads, head_dim]``. A sequence's block table lists its pages in order;
    token ``t`` lives in page ``block_table[t // block_size]`` at slot ``t % block_size``.

Adapter weights
    Stored as rows, never padded to a maximum rank. For adapter slot ``s``, layer ``l`` and
    projection ``p`` (``0 <= p < num_projections``; the server owns which index is which projection)
    with rank ``r = ranks[s, l, p]``:

    * row ``i < r`` of ``A`` (PEFT ``lora_A.weight``, shape ``[r, in_features]``) starts at flat
      element offset ``a_rows[s, l, p, i]`` and runs for ``in_features`` elements;
    * row ``i < r`` of ``B^T`` (PEFT ``lora_B.weight`` transposed, shape ``[r, out_features]``)
      starts at ``b_rows[s, l, p, i]`` and runs for ``out_features`` elements;
    * ``scales[s, l, p]`` is ``lora_alpha / r`` (or ``lora_alpha / sqrt(r)`` for rsLoRA).

    A row never crosses a page boundary; rows of one matrix need not be adjacent. ``r == 0`` means
    the adapter does not touch that projection. Offsets beyond ``r`` are ignored (kept at 0).

    Row starts that are multiples of :data:`ROW_ALIGN` elements let the kernels use 16-byte vector
    loads. A pool that guarantees this for every row says so with ``LoraTables.row_align =
    ROW_ALIGN``; the default ``row_align = 1`` promises nothing and is always correct.

Segments
    Per engine step, tokens that share an adapter form a segment. :class:`Segments` is built once
    per step and shared by every layer: segment ``g`` covers positions
    ``starts[g] .. starts[g] + lengths[g]`` of the step's token order and uses adapter slot
    ``slots[g]`` (``-1``: no adapter, the segment is skipped). Position ``i`` maps to row
    ``token_index[i]`` of ``x``/``y`` when a permutation is given, else to row ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_ADAPTER = -1

# Row-start alignment (elements) that lets kernels issue 16-byte loads of 16-bit weights.
ROW_ALIGN = 8


@dataclass(frozen=True)
class KVGeometry:
    """Shape of the KV cache; fixes the page size of the whole arena."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVGeometry.{name} must be >= 1")

    @property
    def page_elems(self) -> int:
        """Elements in one page: one KV block of every layer, K and V."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim


def kv_cache_views(arena: torch.Tensor, geom: KVGeometry, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-copy K and V views of one layer, each ``[num_pages, block_size, num_kv_heads, head_dim]``."""
    if arena.dim() != 1 or arena.numel() % geom.page_elems:
        raise ValueError("arena must be a flat tensor holding a whole number of pages")
    pages = arena.view(-1, geom.num_layers, 2, geom.block_size, geom.num_kv_heads, geom.head_dim)
    return pages[:, layer, 0], pages[:, layer, 1]


@dataclass
class LoraTables:
    """Where every resident adapter's rows live. Updated on load/unload, read every step."""

    a_rows: torch.Tensor  # int64 [max_slots, num_layers, num_projections, max_rank]
    b_rows: torch.Tensor  # int64 [max_slots, num_layers, num_projections, max_rank]
    ranks: torch.Tensor  # int32 [max_slots, num_layers, num_projections]
    scales: torch.Tensor  # float32 [max_slots, num_layers, num_projections]
    row_align: int = 1  # every row start is a multiple of this many elements (ROW_ALIGN or 1)

    @classmethod
    def empty(
        cls,
        max_slots: int,
        num_layers: int,
        max_rank: int,
        device: torch.device | str = "cpu",
        row_align: int = 1,
        *,
        num_projections: int,
    ) -> LoraTables:
        """Tables with every slot free (rank 0 everywhere); ``num_projections`` adapted projections per layer."""
        shape = (max_slots, num_layers, num_projections)
        return cls(
            a_rows=torch.zeros(*shape, max_rank, dtype=torch.int64, device=device),
            b_rows=torch.zeros(*shape, max_rank, dtype=torch.int64, device=device),
            ranks=torch.zeros(shape, dtype=torch.int32, device=device),
            scales=torch.zeros(shape, dtype=torch.float32, device=device),
            row_align=row_align,
        )

    @property
    def max_slots(self) -> int:
        return self.ranks.shape[0]

    @property
    def max_rank(self) -> int:
        return self.a_rows.shape[-1]

    def layer(self, layer: int) -> LayerLoraTables:
        """Views of one layer's tables (no copy)."""
        return LayerLoraTables(
            a_rows=self.a_rows[:, layer],
            b_rows=self.b_rows[:, layer],
            ranks=self.ranks[:, layer],
            scales=self.scales[:, layer],
            row_align=self.row_align,
        )

    def clear_slot(self, slot: int) -> None:
        """Forget an adapter: its projections become rank 0 (skipped by every kernel)."""
        self.ranks[slot].zero_()
        self.scales[slot].zero_()
        self.a_rows[slot].zero_()
        self.b_rows[slot].zero_()


@dataclass
class LayerLoraTables:
    """One layer's slice of :class:`LoraTables`.

    Row tables are ``[max_slots, num_projections, max_rank]``, ranks and scales ``[max_slots, num_projections]``.
    """

    a_rows: torch.Tensor
    b_rows: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    row_align: int = 1


@dataclass
class Segments:
    """Segment metadata for one engine step, shared by every layer."""

    starts: torch.Tensor  # int32 [G]
    lengths: torch.Tensor  # int32 [G]
    slots: torch.Tensor  # int32 [G]; NO_ADAPTER (-1) = skip
    num_tokens: int
    max_len: int  # longest segment (host int: sizes the launch grid)
    max_rank: int  # widest rank any segment's adapter uses in any layer/projection (host int)
    token_index: torch.Tensor | None = None  # int64 [num_tokens] or None for identity

    @property
    def num_segments(self) -> int:
        return int(self.starts.numel())

    @classmethod
    def from_token_slots(
        cls,
        token_slots: list[int],
        slot_max_rank: dict[int, int] | list[int],
        device: torch.device | str = "cpu",
        token_index: list[int] | None = None,
    ) -> Segments:
        """Group consecutive positions with the same slot into segments.

        ``token_slots[i]`` is the adapter slot of position ``i`` (in ``token_index`` order when given).
        ``slot_max_rank[slot]`` is that slot's widest rank over all layers and projections.
        """
        runs = SegmentRuns()
        for slot in token_slots:
            runs.add(slot, 1)
        index = None
        if token_index is not None:
            if sorted(token_index) != list(range(len(token_slots))):
                raise ValueError("token_index must be a permutation of the step's tokens")
            index = torch.tensor(token_index, dtype=torch.int64, device=device)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return runs.segments(tensor(runs.starts), tensor(runs.lengths), tensor(runs.slots), slot_max_rank, index)

    def to(self, device: torch.device | str) -> Segments:
        return Segments(
            starts=self.starts.to(device),
            lengths=self.lengths.to(device),
            slots=self.slots.to(device),
            num_tokens=self.num_tokens,
            max_len=self.max_len,
            max_rank=self.max_rank,
            token_index=None if self.token_index is None else self.token_index.to(device),
        )


class SegmentRuns:
    """The one way a step's tokens become segments: runs of tokens, listed in step order, merge while they
    share an adapter slot. Host-side lists; :meth:`segments` wraps them once they are in tensors."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.lengths: list[int] = []
        self.slots: list[int] = []
        self.num_tokens = 0

    def add(self, slot: int, length: int) -> None:
        """The next ``length`` tokens of the step use adapter ``slot``."""
        if self.slots and self.slots[-1] == slot:
            self.lengths[-1] += length
        else:
            self.starts.append(self.num_tokens)
            self.lengths.append(length)
            self.slots.append(slot)
        self.num_tokens += length

    def segments(
        self,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
        slot_max_rank: dict[int, int] | list[int],
        token_index: torch.Tensor | None = None,
    ) -> Segments:
        """:class:`Segments` over tensors holding :attr:`starts`, :attr:`lengths` and :attr:`slots` (int32)."""
        used = {s for s in self.slots if s != NO_ADAPTER}
        return Segments(
            starts=starts,
            lengths=lengths,
            slots=slots,
            num_tokens=self.num_tokens,
            max_len=max(self.lengths, default=0),
            max_rank=max((slot_max_rank[s] for s in used), default=0),
            token_index=token_index,
        )


@dataclass(frozen=True)
class SliceGroup:
    """Projections fused into one launch: their indices and where each one's output starts in ``y``."""

    projections: tuple[int, ...]
    out_offsets: tuple[int, ...]
    out_widths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.projections) == len(self.out_offsets) == len(self.out_widths)):
            raise ValueError("SliceGroup fields must have one entry per projection")

    @property
    def num_slices(self) -> int:
        return len(self.projections)

    @classmethod
    def contiguous(cls, projections: tuple[int, ...], widths: tuple[int, ...]) -> SliceGroup:
        """Slices laid side by side in ``y`` (e.g. a fused qkv output)."""
        offsets, at = [], 0
        for w in widths:
            offsets.append(at)
            at += w
        return cls(tuple(projections), tuple(offsets), tuple(widths))
