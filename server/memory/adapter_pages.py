"""Adapters in pool pages: pack their rows into pages, fill ``LoraTables``, manage slots.

Rows are stored unpadded (pages proportional to rank). Rows that one kernel call reads together stay
adjacent within a page when they fit: the A rows of a fused group (q/k/v, gate/up) form one block, the
B^T rows of each projection another, so the CPU path can view them in place as one matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

import torch

from core.adapter_format import PROJECTIONS, AdapterWeights, BaseShapes
from core.errors import InvalidRequest, ServiceUnavailable
from loraplex_kernels import DOWN, GATE_UP, QKV, ROW_ALIGN, LoraTables
from loraplex_kernels import O as O_PROJ
from server.memory.pool import PagePool, PageUse

GROUPS: tuple[tuple[int, ...], ...] = (QKV, O_PROJ, GATE_UP, DOWN)


class AdapterRankTooLarge(InvalidRequest):
    """An adapter's rank exceeds the server's ``max_lora_rank``."""

    default_code = "adapter_rank_too_large"


class NoFreeAdapterSlot(ServiceUnavailable):
    """Every adapter slot is taken; unload (evict) an adapter first."""

    default_code = "no_free_adapter_slot"


@dataclass(frozen=True)
class RowBlock:
    """Rows kept adjacent: ``rows[k] = (projection, i)`` is row ``i`` of that projection's A or B^T."""

    layer: int
    kind: str  # "A" or "B"
    width: int
    rows: tuple[tuple[int, int], ...]

    @property
    def elems(self) -> int:
        return self.width * len(self.rows)


@dataclass(frozen=True)
class Placement:
    block: RowBlock
    page: int  # index into the adapter's page list
    offset: int  # element offset inside the page


@dataclass
class ResidentAdapter:
    name: str
    slot: int
    pages: list[int]
    max_rank: int
    ranks: dict[tuple[int, str], int] = field(default_factory=dict)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


def row_blocks(ranks: dict[tuple[int, int], int], shapes: BaseShapes, page_elems: int) -> list[RowBlock]:
    """The blocks of one adapter, from ``ranks[(layer, projection index)]``; big blocks split at row boundaries."""
    blocks = []
    for layer in range(shapes.num_layers):
        for group in GROUPS:
            width = shapes.in_out(PROJECTIONS[group[0]])[0]
            a_rows = tuple((p, i) for p in group for i in range(ranks.get((layer, p), 0)))
            blocks += _split(RowBlock(layer, "A", width, a_rows), page_elems)
            for p in group:
                b_rows = tuple((p, i) for i in range(ranks.get((layer, p), 0)))
                blocks += _split(RowBlock(layer, "B", shapes.in_out(PROJECTIONS[p])[1], b_rows), page_elems)
    return blocks


def _split(block: RowBlock, page_elems: int) -> list[RowBlock]:
    if not block.rows:
        return []
    if block.width > page_elems:
        raise ValueError(f"a row of {block.width} elements does not fit a page of {page_elems}")
    per_page = page_elems // block.width
    return [
        RowBlock(block.layer, block.kind, block.width, block.rows[k : k + per_page])
        for k in range(0, len(block.rows), per_page)
    ]


def pack_blocks(blocks: list[RowBlock], page_elems: int) -> tuple[int, list[Placement]]:
    """First-fit decreasing: the number of pages used and where each block goes."""
    used: list[int] = []
    placements = []
    for block in sorted(blocks, key=lambda b: b.elems, reverse=True):
        page = next((k for k, fill in enumerate(used) if fill + block.elems <= page_elems), None)
        if page is None:
            page = len(used)
            used.append(0)
        placements.append(Placement(block, page, used[page]))
        used[page] += block.elems
    return len(used), placements


def row_alignment(shapes: BaseShapes, page_elems: int) -> int:
    """``ROW_ALIGN`` when every row :func:`pack_blocks` places starts on it (all widths and the page size are
    multiples), else 1. GPU kernels use it to load adapter rows with wide vector copies."""
    widths = [w for proj in PROJECTIONS for w in shapes.in_out(proj)]
    return ROW_ALIGN if all(w % ROW_ALIGN == 0 for w in [*widths, page_elems]) else 1


def _ranks_of(weights: AdapterWeights) -> dict[tuple[int, int], int]:
    return {(layer, PROJECTIONS.index(proj)): t.a.shape[0] for (layer, proj), t in weights.modules.items()}


class AdapterPages:
    """Resident adapters: their slots in ``LoraTables`` and their pages in the pool."""

    def __init__(self, pool: PagePool, tables: LoraTables, shapes: BaseShapes) -> None:
        self.pool = pool
        self.tables = tables
        self.shapes = shapes
        self._free_slots = list(range(tables.max_slots - 1, -1, -1))
        self.resident: dict[str, ResidentAdapter] = {}
        # Host copy of each slot's widest rank: Segments need it every step without a device sync.
        self.slot_max_rank: list[int] = [0] * tables.max_slots

    def pages_needed(self, weights: AdapterWeights) -> int:
        """Pages :meth:`place` would take for these weights."""
        return pack_blocks(row_blocks(_ranks_of(weights), self.shapes, self.pool.page_elems), self.pool.page_elems)[0]

    def place(self, name: str, weights: AdapterWeights) -> ResidentAdapter:
        """Copy an adapter's rows into freshly allocated pages and publish it in a free slot."""
        if weights.max_rank > self.tables.max_rank:
            raise AdapterRankTooLarge(
                f"adapter {name!r} has rank {weights.max_rank}; this server serves ranks up to {self.tables.max_rank}",
                param="rank",
            )
        self._check_shapes(weights)
        if not self._free_slots:
            raise NoFreeAdapterSlot(f"all {self.tables.max_slots} adapter slots are in use; unload one first")
        ranks = _ranks_of(weights)
        num_pages, placements = pack_blocks(row_blocks(ranks, self.shapes, self.pool.page_elems), self.pool.page_elems)
        pages = self.pool.allocate(num_pages, PageUse.ADAPTER)
        slot = self._free_slots.pop()
        shape = self.tables.a_rows.shape[1:]
        a_rows = torch.zeros(shape, dtype=torch.int64)
        b_rows = torch.zeros(shape, dtype=torch.int64)
        ranks_t = torch.zeros(shape[:-1], dtype=torch.int32)
        scales = torch.zeros(shape[:-1], dtype=torch.float32)
        for (layer, proj), tensors in weights.modules.items():
            p = PROJECTIONS.index(proj)
            ranks_t[layer, p] = tensors.a.shape[0]
            scales[layer, p] = tensors.scale
        for placement in placements:
            block = placement.block
            base = pages[placement.page] * self.pool.page_elems + placement.offset
            offsets = (a_rows if block.kind == "A" else b_rows)[block.layer]
            chunks, k = [], 0
            # A block's rows are runs of consecutive row indices of one projection: copy and index each
            # run as a slice rather than row by row (placement sits between engine steps).
            for p, run in groupby(block.rows, key=lambda row: row[0]):
                idx = [i for _, i in run]
                lo, hi = idx[0], idx[-1] + 1
                tensors = weights.modules[(block.layer, PROJECTIONS[p])]
                chunks.append(tensors.a[lo:hi] if block.kind == "A" else tensors.b[:, lo:hi].T)
                offsets[p, lo:hi] = base + (k + torch.arange(hi - lo, dtype=torch.int64)) * block.width
                k += hi - lo
            data = torch.cat(chunks).reshape(-1).to(self.pool.arena.dtype)
            self.pool.arena[base : base + block.elems].copy_(data)
        device = self.tables.a_rows.device
        self.tables.a_rows[slot].copy_(a_rows.to(device))
        self.tables.b_rows[slot].copy_(b_rows.to(device))
        self.tables.ranks[slot].copy_(ranks_t.to(device))
        self.tables.scales[slot].copy_(scales.to(device))
        self.slot_max_rank[slot] = weights.max_rank
        adapter = ResidentAdapter(
            name=name,
            slot=slot,
            pages=pages,
            max_rank=weights.max_rank,
            ranks={key: t.a.shape[0] for key, t in weights.modules.items()},
        )
        self.resident[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        """Clear the adapter's slot and give its pages back to the pool."""
        adapter = self.resident.pop(name)
        self.tables.clear_slot(adapter.slot)
        self.slot_max_rank[adapter.slot] = 0
        self._free_slots.append(adapter.slot)
        self.pool.release(adapter.pages, PageUse.ADAPTER)

    def _check_shapes(self, weights: AdapterWeights) -> None:
        for (layer, proj), t in weights.modules.items():
            if not 0 <= layer < self.shapes.num_layers or proj not in PROJECTIONS:
                raise InvalidRequest(f"adapter module ({layer}, {proj}) does not exist in the base model")
            in_f, out_f = self.shapes.in_out(proj)
            r = t.a.shape[0]
            if r < 1 or tuple(t.a.shape) != (r, in_f) or tuple(t.b.shape) != (out_f, r):
                raise InvalidRequest(
                    f"adapter tensors of layer {layer} {proj} have shapes {list(t.a.shape)}/{list(t.b.shape)}, "
                    f"expected [r, {in_f}]/[{out_f}, r]"
                )
