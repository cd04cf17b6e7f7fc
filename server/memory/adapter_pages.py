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


@dataclass(frozen=True, eq=False)
class AdapterPlan:
    """An adapter packed for the pool, worked out once and off the engine thread: the contents of its pages and
    where each row sits in them. :meth:`AdapterPages.write` places exactly this with one page copy, so a placement
    between engine steps costs microseconds, not a pass over every row. The host tier keeps plans, not weights."""

    ranks: dict[tuple[int, int], int]  # (layer, projection index) -> rank
    num_pages: int
    image: torch.Tensor  # [num_pages, page_elems] in the arena's dtype (pinned when the arena is on a GPU)
    a_offsets: torch.Tensor  # int64 [layers, projections, max_rank]: each A row's start in the image; -1: none
    b_offsets: torch.Tensor  # the same for B^T rows
    rank_table: torch.Tensor  # int32 [layers, projections]
    scales: torch.Tensor  # float32 [layers, projections]
    identity: bytes = b""  # content digest (:func:`weights_identity`): the prefix cache keys its KV pages by it
    # Tensor parallelism: ranks 1..N-1's page images of their slices, in this plan's layout (every rank's is the same).
    rank_images: tuple[torch.Tensor, ...] = ()

    @property
    def max_rank(self) -> int:
        return max(self.ranks.values(), default=0)

    @property
    def nbytes(self) -> int:
        """Host bytes this plan holds (what the host tier budgets)."""
        tensors = (self.image, *self.rank_images, self.a_offsets, self.b_offsets, self.rank_table, self.scales)
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def module_ranks(self) -> dict[tuple[int, str], int]:
        """Rank by ``(layer, projection name)``."""
        return {(layer, PROJECTIONS[p]): r for (layer, p), r in self.ranks.items()}


def weights_identity(weights: AdapterWeights) -> bytes:
    """A digest of everything that shapes an adapter's outputs (modules, scales, tensor values): adapters with
    the same identity compute the same K/V, so the prefix cache may share pages between them.

    Every load from disk or the object store computes it on the loader thread, so it is cheap: SHA-256 (about
    twice BLAKE2b's rate on CPUs with SHA instructions) straight over the tensors' memory, no copy."""
    h = hashlib.sha256(b"loraplex-adapter\0")
    for (layer, proj), t in sorted(weights.modules.items()):
        h.update(f"{layer}:{proj}:{t.scale!r}:{tuple(t.a.shape)}:{tuple(t.b.shape)}\0".encode())
        for tensor in (t.a, t.b):
            h.update(memoryview(tensor.detach().to("cpu", torch.float32).contiguous().numpy()))
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
        """Check the weights against the base model and this server's limits, then pack them into page images.

        Reads only what never changes after start-up (shapes, page size, dtype), so any thread may plan; the
        adapter loader does, so the engine thread only copies pages. ``identity`` is the weights'
        :func:`weights_identity` when the caller already has it; otherwise it is computed here."""
        if weights.max_rank > self.tables.max_rank:
            raise AdapterRankTooLarge(
                f"adapter {name!r} has rank {weights.max_rank}; this server serves ranks up to {self.tables.max_rank}",
                param="rank",
            )
        check_shapes(weights, self.shapes)
        ranks = _ranks_of(weights)
        page_elems = self.pool.page_elems
        num_pages, placements = pack_blocks(row_blocks(ranks, self.shapes, page_elems), page_elems)
        image, a_offsets, b_offsets = self._pack(weights, num_pages, placements)
        table_shape = self.tables.ranks.shape[1:]
        rank_table = torch.zeros(table_shape, dtype=torch.int32)
        scales = torch.zeros(table_shape, dtype=torch.float32)
        for (layer, proj), tensors in weights.modules.items():
            p = PROJECTIONS.index(proj)
            rank_table[layer, p] = tensors.a.shape[0]
            scales[layer, p] = tensors.scale
        return AdapterPlan(
            ranks,
            num_pages,
            image,
            a_offsets,
            b_offsets,
            rank_table,
            scales,
            identity or weights_identity(weights),
        )

    def _pack(
        self, weights: AdapterWeights, num_pages: int, placements: list[Placement]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pages' contents as :meth:`write` copies them, and each A and B^T row's start in them (-1: none)."""
        page_elems = self.pool.page_elems
        image = torch.zeros(num_pages * page_elems, dtype=self.pool.arena.dtype)
        row_shape = self.tables.a_rows.shape[1:]
        a_offsets = torch.full(row_shape, -1, dtype=torch.int64)
        b_offsets = torch.full(row_shape, -1, dtype=torch.int64)
        for placement in placements:
            block = placement.block
            start = placement.page * page_elems + placement.offset
            offsets = (a_offsets if block.kind == "A" else b_offsets)[block.layer]
            chunks, k = [], 0
            # A block's rows are runs of consecutive row indices of one projection: copy each run as a slice.
            for p, run in groupby(block.rows, key=lambda row: row[0]):
                idx = [i for _, i in run]
                lo, hi = idx[0], idx[-1] + 1
                tensors = weights.modules[(block.layer, PROJECTIONS[p])]
                chunks.append(tensors.a[lo:hi] if block.kind == "A" else tensors.b[:, lo:hi].T)
                offsets[p, lo:hi] = start + (k + torch.arange(hi - lo, dtype=torch.int64)) * block.width
                k += hi - lo
            image[start : start + block.elems] = torch.cat(chunks).reshape(-1)
        image = image.view(num_pages, page_elems)
        if self.pool.arena.is_cuda:
            image = image.pin_memory()  # placement's host-to-device copy then runs without staging
        return image, a_offsets, b_offsets

    def write(self, plan: AdapterPlan) -> tuple[int, list[int]]:
        """Copy a planned adapter's page images into freshly allocated pages and publish them in a free slot.

        Returns ``(slot, pages)``. All or nothing: on ``NoFreeAdapterSlot`` or ``PoolExhausted`` nothing is taken.
        """
        if not self._free_slots:
            raise NoFreeAdapterSlot(f"all {self.tables.max_slots} adapter slots are in use; unload one first")
        pages = self.pool.allocate(plan.num_pages, PageUse.ADAPTER)
        slot = self._free_slots.pop()
        self.publish(slot, pages, plan.image, plan)
        return slot, pages

    def publish(self, slot: int, pages: list[int], image: torch.Tensor, plan: AdapterPlan) -> None:
        """Copy ``image`` (laid out as ``plan``) into ``pages`` and fill ``slot``'s table rows. Takes nothing from
        the pool: :meth:`write` has, or (tensor parallelism) rank 0 has for every rank."""
        page_elems = self.pool.page_elems
        index = torch.tensor(pages, dtype=torch.int64)
        device = self.pool.arena.device
        image = image.to(device, non_blocking=True)
        self.pool.arena.view(-1, page_elems).index_copy_(0, index.to(device), image)

        def rows(offsets: torch.Tensor) -> torch.Tensor:
            """Image offsets to arena offsets: the plan's page k is ``pages[k]``; absent rows stay 0."""
            placed = offsets.clamp(min=0)
            absolute = index[placed // page_elems] * page_elems + placed % page_elems
            return torch.where(offsets >= 0, absolute, 0).to(self.tables.a_rows.device)

        self.tables.a_rows[slot].copy_(rows(plan.a_offsets))
        self.tables.b_rows[slot].copy_(rows(plan.b_offsets))
        self.tables.ranks[slot].copy_(plan.rank_table.to(device))
        self.tables.scales[slot].copy_(plan.scales.to(device))
        self.slot_max_rank[slot] = plan.max_rank

    def clear(self, slot: int, pages: list[int]) -> None:
        """Clear a slot and give its pages back to the pool."""
        self.unpublish(slot)
        self._free_slots.append(slot)
        self.pool.release(pages, PageUse.ADAPTER)

    def unpublish(self, slot: int) -> None:
        """Clear ``slot``'s table rows (its pages are the pool's business)."""
        self.tables.clear_slot(slot)
        self.slot_max_rank[slot] = 0


def check_shapes(weights: AdapterWeights, shapes: BaseShapes) -> None:
    """Raise InvalidRequest unless every module of ``weights`` exists in the base model with its shapes."""
    for (layer, proj), t in weights.modules.items():
        if not 0 <= layer < shapes.num_layers or proj not in PROJECTIONS:
            raise InvalidRequest(f"adapter module ({layer}, {proj}) does not exist in the base model")
        in_f, out_f = shapes.in_out(proj)
        r = t.a.shape[0]
        if r < 1 or tuple(t.a.shape) != (r, in_f) or tuple(t.b.shape) != (out_f, r):
            raise InvalidRequest(
                f"adapter tensors of layer {layer} {proj} have shapes {list(t.a.shape)}/{list(t.b.shape)}, "
                f"expected [r, {in_f}]/[{out_f}, r]"
            )
