"""Adapters in pool pages: plan how their rows pack into pages, write them, fill ``LoraTables``, manage slots.

Rows are stored unpadded (pages proportional to rank). Rows that one kernel call reads together stay
adjacent within a page when they fit: the A rows of a fused group (q/k/v, gate/up) form one block, the
B^T rows of each projection another, so the CPU path can view them in place as one matrix.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import groupby

import torch

from core.adapter_format import AdapterWeights, BaseShapes
from core.errors import InvalidRequest, ServiceUnavailable
from core.projections import PROJECTION_GROUPS, PROJECTIONS
from loraplex_kernels import ROW_ALIGN, LoraTables
from server.memory.pool import PagePool, PageUse

GROUPS: tuple[tuple[int, ...], ...] = tuple(group.indices for group in PROJECTION_GROUPS)


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


@dataclass(frozen=True)
class AdapterPlan:
    """Where an adapter's rows will go, worked out once: :meth:`AdapterPages.write` places exactly this."""

    weights: AdapterWeights
    ranks: dict[tuple[int, int], int]  # (layer, projection index) -> rank
    num_pages: int
    placements: tuple[Placement, ...]
    identity: bytes = b""  # content digest (:func:`weights_identity`): the prefix cache keys its KV pages by it

    @property
    def max_rank(self) -> int:
        return self.weights.max_rank


def weights_identity(weights: AdapterWeights) -> bytes:
    """A digest of everything that shapes an adapter's outputs (modules, scales, tensor values): adapters with
    the same identity compute the same K/V, so the prefix cache may share pages between them."""
    h = hashlib.blake2b(b"loraplex-adapter\0", digest_size=32)
    for (layer, proj), t in sorted(weights.modules.items()):
        h.update(f"{layer}:{proj}:{t.scale!r}:{tuple(t.a.shape)}:{tuple(t.b.shape)}\0".encode())
        for tensor in (t.a, t.b):
            h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.digest()


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
    """Adapter rows in pool pages and their slots in ``LoraTables``; knows nothing of names or requests."""

    def __init__(self, pool: PagePool, tables: LoraTables, shapes: BaseShapes) -> None:
        self.pool = pool
        self.tables = tables
        self.shapes = shapes
        self._free_slots = list(range(tables.max_slots - 1, -1, -1))
        # Host copy of each slot's widest rank: Segments need it every step without a device sync.
        self.slot_max_rank: list[int] = [0] * tables.max_slots

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def plan(self, name: str, weights: AdapterWeights, identity: bytes | None = None) -> AdapterPlan:
        """Check the weights against the base model and this server's limits, then pack them into pages.

        ``identity`` is the weights' :func:`weights_identity` when the caller already computed it (off the engine
        thread); otherwise it is computed here."""
        if weights.max_rank > self.tables.max_rank:
            raise AdapterRankTooLarge(
                f"adapter {name!r} has rank {weights.max_rank}; this server serves ranks up to {self.tables.max_rank}",
                param="rank",
            )
        self._check_shapes(weights)
        ranks = _ranks_of(weights)
        page_elems = self.pool.page_elems
        num_pages, placements = pack_blocks(row_blocks(ranks, self.shapes, page_elems), page_elems)
        return AdapterPlan(weights, ranks, num_pages, tuple(placements), identity or weights_identity(weights))

    def write(self, plan: AdapterPlan) -> tuple[int, list[int]]:
        """Copy a planned adapter's rows into freshly allocated pages and publish them in a free slot.

        Returns ``(slot, pages)``. All or nothing: on ``NoFreeAdapterSlot`` or ``PoolExhausted`` nothing is taken.
        """
        if not self._free_slots:
            raise NoFreeAdapterSlot(f"all {self.tables.max_slots} adapter slots are in use; unload one first")
        pages = self.pool.allocate(plan.num_pages, PageUse.ADAPTER)
        slot = self._free_slots.pop()
        weights = plan.weights
        shape = self.tables.a_rows.shape[1:]
        a_rows = torch.zeros(shape, dtype=torch.int64)
        b_rows = torch.zeros(shape, dtype=torch.int64)
        ranks_t = torch.zeros(shape[:-1], dtype=torch.int32)
        scales = torch.zeros(shape[:-1], dtype=torch.float32)
        for (layer, proj), tensors in weights.modules.items():
            p = PROJECTIONS.index(proj)
            ranks_t[layer, p] = tensors.a.shape[0]
            scales[layer, p] = tensors.scale
        for placement in plan.placements:
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
        return slot, pages

    def clear(self, slot: int, pages: list[int]) -> None:
        """Clear a slot and give its pages back to the pool."""
        self.tables.clear_slot(slot)
        self.slot_max_rank[slot] = 0
        self._free_slots.append(slot)
        self.pool.release(pages, PageUse.ADAPTER)

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
