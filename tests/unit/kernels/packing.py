"""Place random LoRA weights into a paged arena exactly as ``kernels/layout.py`` describes.

Rows of every A and B^T land at random places in random pages (never adjacent by construction,
never crossing a page), and everything outside the rows is NaN, so a kernel that reads one element
too far, or misses a mask, poisons its output instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.projections import NUM_PROJECTIONS
from loraplex_kernels.layout import LayerLoraTables, LoraTables

# Key of one adapted projection: (adapter slot, projection index).
Key = tuple[int, int]


@dataclass
class PackedLora:
    """An arena holding adapter rows, its tables, and the dense fp32 copies of what was stored."""

    arena: torch.Tensor
    tables: LoraTables
    layer: int
    a: dict[Key, torch.Tensor] = field(default_factory=dict)  # [r, in_features]
    b: dict[Key, torch.Tensor] = field(default_factory=dict)  # [out_features, r]
    scales: dict[Key, float] = field(default_factory=dict)

    def layer_tables(self) -> LayerLoraTables:
        """The layer the weights were written to (strided views, as the server passes them)."""
        return self.tables.layer(self.layer)


def _place_rows(widths: list[int], page_elems: int, align: int, gen: torch.Generator) -> list[int]:
    """Flat offsets for rows of the given widths: random page, random gap, aligned, inside the page."""
    if max(widths, default=0) > page_elems:
        raise ValueError(f"a row of {max(widths)} elements cannot fit a page of {page_elems}")
    # Twice the room the rows need, so every row has several candidate pages to land in.
    num_pages = max(2, 2 * sum(widths) // page_elems + 2)
    fill = [0] * num_pages
    offsets = []
    for width in widths:
        for page in torch.randperm(num_pages, generator=gen).tolist():
            gap = int(torch.randint(0, 4, (1,), generator=gen)) * align + align - 1
            start = (fill[page] + gap) // align * align
            if start + width <= page_elems:
                fill[page] = start + width
                offsets.append(page * page_elems + start)
                break
        else:
            # Every page is too full: open a fresh one at the end.
            fill.append(width)
            offsets.append((len(fill) - 1) * page_elems)
    return offsets


def pack_lora(
    ranks: dict[Key, int],
    in_features: int,
    out_features: dict[int, int],
    *,
    dtype: torch.dtype,
    page_elems: int = 4096,
    max_slots: int = 8,
    max_rank: int = 64,
    num_layers: int = 2,
    layer: int = 1,
    row_align: int = 1,
    seed: int = 0,
) -> PackedLora:
    """Random adapters with ``ranks[(slot, proj)]`` written row by row into a fresh arena."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[tuple[Key, str, int, int]] = []
    for key, rank in ranks.items():
        rows += [(key, "a", i, in_features) for i in range(rank)]
        rows += [(key, "b", i, out_features[key[1]]) for i in range(rank)]
    order = torch.randperm(len(rows), generator=gen).tolist()
    offsets = _place_rows([rows[i][3] for i in order], page_elems, row_align, gen)
    num_pages = max((off + page_elems) // page_elems for off in offsets) if offsets else 1
    arena = torch.full((num_pages * page_elems,), float("nan"), dtype=dtype)
    tables = LoraTables.empty(max_slots, num_layers, max_rank, row_align=row_align, num_projections=NUM_PROJECTIONS)
    packed = PackedLora(arena=arena, tables=tables, layer=layer)
    for (slot, proj), rank in ranks.items():
        tables.ranks[slot, layer, proj] = rank
        if rank == 0:
            continue
        scale = 0.5 + float(torch.rand((), generator=gen))
        tables.scales[slot, layer, proj] = scale
        packed.scales[slot, proj] = scale
        # Unit-variance v = x A^T and y deltas of order one, whatever the width.
        a = torch.randn(rank, in_features, generator=gen) / in_features**0.5
        b = torch.randn(out_features[proj], rank, generator=gen) / rank**0.5
        packed.a[slot, proj] = a.to(dtype).float()
        packed.b[slot, proj] = b.to(dtype).float()
    for i, offset in zip(order, offsets, strict=True):
        (slot, proj), kind, row, width = rows[i]
        source = packed.a[slot, proj][row] if kind == "a" else packed.b[slot, proj][:, row]
        arena[offset : offset + width] = source.to(dtype)
        (tables.a_rows if kind == "a" else tables.b_rows)[slot, layer, proj, row] = offset
    return packed
