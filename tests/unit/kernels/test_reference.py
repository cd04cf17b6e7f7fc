"""The oracle itself: the torch reference against dense ``scale * B @ A`` built without the arena."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from loraplex_kernels import reference
from tests.unit.kernels.cases import adapted_mask, dense_delta, make_batch
from tests.unit.kernels.packing import pack_lora
from tests.unit.kernels.sweep import CASES, DTYPES, y_tolerance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_add_lora_equals_dense_delta(case, dtype):
    batch = make_batch(case, dtype)
    y = batch.y.clone()
    reference.add_lora(y, batch.x, batch.packed.arena, batch.packed.layer_tables(), batch.group, batch.segs)
    # The dense result is rounded to y's dtype once, as any correct kernel must do.
    expected = (batch.y.double() + dense_delta(batch)).to(dtype)
    assert_close(y.float(), expected.float(), **y_tolerance(dtype))
    untouched = ~adapted_mask(batch)
    assert torch.equal(y[untouched], batch.y[untouched])


def test_reference_shrink_is_x_times_a_transposed():
    batch = make_batch(CASES[2], torch.float32)
    v = reference.sgmv_shrink(batch.x, batch.packed.arena, batch.packed.layer_tables(), batch.group, batch.segs)
    segs = batch.segs
    assert v.shape == (segs.num_tokens, batch.group.num_slices, segs.max_rank)
    order = segs.token_index.tolist()
    for start, length, slot in zip(segs.starts.tolist(), segs.lengths.tolist(), segs.slots.tolist(), strict=True):
        for row in order[start : start + length]:
            for s, proj in enumerate(batch.group.projections):
                a = batch.packed.a.get((slot, proj))
                expected = torch.zeros(segs.max_rank, dtype=torch.float64)
                if a is not None:
                    expected[: a.shape[0]] = a.double() @ batch.x[row].double()
                assert_close(v[row, s].double(), expected, rtol=1e-5, atol=1e-6)


def test_packing_scatters_rows_inside_pages_and_leaves_nan_elsewhere():
    ranks = {(0, 0): 16, (3, 2): 5}
    packed = pack_lora(ranks, 100, {0: 40, 2: 300}, dtype=torch.float16, page_elems=512, row_align=8, seed=3)
    tables = packed.tables
    spans = []
    for (slot, proj), rank in ranks.items():
        for kind, width in (("a", 100), ("b", 40 if proj == 0 else 300)):
            offsets = (tables.a_rows if kind == "a" else tables.b_rows)[slot, packed.layer, proj, :rank].tolist()
            for off in offsets:
                assert off % 8 == 0
                assert off // 512 == (off + width - 1) // 512, "a row crosses a page boundary"
                spans.append((off, off + width))
            # Rows of one matrix are not laid out back to back (that is the point of paging).
            first = min(offsets)
            assert sorted(offsets) != list(range(first, first + rank * width, width))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    covered = torch.zeros(packed.arena.numel(), dtype=torch.bool)
    for start, end in spans:
        covered[start:end] = True
    assert not packed.arena[covered].isnan().any()
    assert packed.arena[~covered].isnan().all()
