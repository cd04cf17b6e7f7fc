"""Multi-LoRA test scenarios: segments, activations and packed adapters for one fused launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.projections import NUM_PROJECTIONS
from loraplex_kernels.layout import NO_ADAPTER, LoraTables, Segments, SliceGroup
from tests.unit.kernels.packing import PackedLora, pack_lora


@dataclass(frozen=True)
class LoraCase:
    """One batch: segment lengths and slots, each adapter's rank per slice, output slice widths."""

    name: str
    hidden: int
    widths: tuple[int, ...]
    lengths: tuple[int, ...]
    slots: tuple[int, ...]
    ranks: dict[int, tuple[int, ...]]  # slot -> rank of each slice (0: slice not adapted)
    permute: bool = False

    def __str__(self) -> str:
        return self.name

    @property
    def projections(self) -> tuple[int, ...]:
        # Distinct projection indices, spread out so that table strides matter.
        return tuple(range(NUM_PROJECTIONS))[:: NUM_PROJECTIONS // len(self.widths) or 1][: len(self.widths)]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class Batch:
    """Everything one kernel call needs, built from a :class:`LoraCase`."""

    x: torch.Tensor
    y: torch.Tensor
    packed: PackedLora
    group: SliceGroup
    segs: Segments

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor (arena and tables included) on ``device``."""
        packed = self.packed
        tables = packed.tables
        moved = PackedLora(
            arena=packed.arena.to(device),
            tables=LoraTables(
                a_rows=tables.a_rows.to(device),
                b_rows=tables.b_rows.to(device),
                ranks=tables.ranks.to(device),
                scales=tables.scales.to(device),
                row_align=tables.row_align,
            ),
            layer=packed.layer,
            a=packed.a,
            b=packed.b,
            scales=packed.scales,
        )
        return Batch(
            x=self.x.to(device), y=self.y.to(device), packed=moved, group=self.group, segs=self.segs.to(device)
        )


def make_segments(case: LoraCase, seed: int) -> Segments:
    """Segments exactly as listed (zero-length ones included), with an optional random row order."""
    starts, at = [], 0
    for length in case.lengths:
        starts.append(at)
        at += length
    used = {s for s in case.slots if s != NO_ADAPTER}
    index = None
    if case.permute:
        index = torch.randperm(at, generator=torch.Generator().manual_seed(seed))
    return Segments(
        starts=torch.tensor(starts, dtype=torch.int32),
        lengths=torch.tensor(case.lengths, dtype=torch.int32),
        slots=torch.tensor(case.slots, dtype=torch.int32),
        num_tokens=at,
        max_len=max(case.lengths, default=0),
        max_rank=max((max(case.ranks[s]) for s in used), default=0),
        token_index=index,
    )


def make_batch(case: LoraCase, dtype: torch.dtype, seed: int = 0, row_align: int = 1) -> Batch:
    """Random x and y, the case's adapters packed into a paged arena, and its segments."""
    projections = case.projections
    ranks = {(slot, proj): r[i] for slot, r in case.ranks.items() for i, proj in enumerate(projections)}
    out_features = dict(zip(projections, case.widths, strict=True))
    page_elems = max(4096, 2 * max(case.hidden, *case.widths))
    packed = pack_lora(
        ranks, case.hidden, out_features, dtype=dtype, page_elems=page_elems, row_align=row_align, seed=seed
    )
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(case.num_tokens, case.hidden, generator=gen).to(dtype)
    y = torch.randn(case.num_tokens, sum(case.widths), generator=gen).to(dtype)
    group = SliceGroup.contiguous(projections, case.widths)
    return Batch(x=x, y=y, packed=packed, group=group, segs=make_segments(case, seed))


def dense_delta(batch: Batch) -> torch.Tensor:
    """``scale * B A x`` per token in float64 from the dense weights, independent of any arena gather."""
    x = batch.x.double()
    delta = torch.zeros(batch.y.shape, dtype=torch.float64)
    segs = batch.segs
    order = segs.token_index if segs.token_index is not None else torch.arange(segs.num_tokens)
    for start, length, slot in zip(segs.starts.tolist(), segs.lengths.tolist(), segs.slots.tolist(), strict=True):
        if slot == NO_ADAPTER:
            continue
        for proj, offset, width in zip(
            batch.group.projections, batch.group.out_offsets, batch.group.out_widths, strict=True
        ):
            if (slot, proj) not in batch.packed.a:
                continue
            weight = (
                batch.packed.scales[slot, proj]
                * batch.packed.b[slot, proj].double()
                @ batch.packed.a[slot, proj].double()
            )
            for row in order[start : start + length].tolist():
                delta[row, offset : offset + width] = weight @ x[row]
    return delta


def adapted_mask(batch: Batch) -> torch.Tensor:
    """Bool ``[tokens, width]``: True where some adapter slice writes ``y``, False where it must stay put."""
    mask = torch.zeros(batch.y.shape, dtype=torch.bool)
    segs = batch.segs.to("cpu")
    order = segs.token_index if segs.token_index is not None else torch.arange(segs.num_tokens)
    ranks = batch.packed.tables.ranks[:, batch.packed.layer].cpu()
    for start, length, slot in zip(segs.starts.tolist(), segs.lengths.tolist(), segs.slots.tolist(), strict=True):
        if slot == NO_ADAPTER:
            continue
        rows = order[start : start + length]
        for proj, offset, width in zip(
            batch.group.projections, batch.group.out_offsets, batch.group.out_widths, strict=True
        ):
            if int(ranks[slot, proj]) > 0:
                mask[rows, offset : offset + width] = True
    return mask
