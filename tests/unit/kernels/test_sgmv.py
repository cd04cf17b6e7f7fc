"""The Triton SGMV kernels (interpreted on CPU) against the torch reference over the sweep."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from loraplex_kernels import reference, triton_sgmv
from loraplex_kernels.configs import ExpandConfig, ShrinkConfig, expand_config, shrink_config
from tests.unit.kernels.cases import Batch, adapted_mask, make_batch
from tests.unit.kernels.sweep import CASES, DTYPES, V_TOLERANCE, y_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASE = {case.name: case for case in CASES}


def _args(batch: Batch) -> tuple:
    return batch.packed.arena, batch.packed.layer_tables(), batch.group, batch.segs


def _expect(batch: Batch, v: torch.Tensor) -> torch.Tensor:
    y = batch.y.clone()
    reference.sgmv_expand(y, v, *_args(batch))
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_shrink_and_add_lora_match_reference(case, dtype):
    # add_lora is shrink then expand, so with v checked first a y mismatch points at expand.
    batch = make_batch(case, dtype).to(DEVICE)
    rtol, atol = V_TOLERANCE
    v_ref = reference.sgmv_shrink(batch.x, *_args(batch))
    assert_close(triton_sgmv.sgmv_shrink(batch.x, *_args(batch)), v_ref, rtol=rtol, atol=atol)
    y = batch.y.clone()
    triton_sgmv.add_lora(y, batch.x, *_args(batch))
    assert_close(y.float(), _expect(batch, v_ref).float(), **y_tolerance(dtype))


@pytest.mark.parametrize("case", CASES[1:5], ids=str)
def test_expand_alone_matches_reference(case):
    batch = make_batch(case, torch.bfloat16).to(DEVICE)
    v_ref = reference.sgmv_shrink(batch.x, *_args(batch))
    y = batch.y.clone()
    triton_sgmv.sgmv_expand(y, v_ref, *_args(batch))
    assert_close(y.float(), _expect(batch, v_ref).float(), **y_tolerance(torch.bfloat16))


@pytest.mark.parametrize("case", [c for c in CASES if -1 in c.slots or any(0 in r for r in c.ranks.values())], ids=str)
def test_untouched_rows_and_rank0_slices_stay_bit_identical(case):
    batch = make_batch(case, torch.bfloat16).to(DEVICE)
    y = batch.y.clone()
    triton_sgmv.add_lora(y, batch.x, *_args(batch))
    adapted = adapted_mask(batch).to(DEVICE)
    assert (~adapted).any()
    assert torch.equal(y[~adapted], batch.y[~adapted])
    if adapted.any():
        assert not torch.equal(y[adapted], batch.y[adapted])


# GPU-sized tiles: split-K with atomics, several rank chunks, several (partial) column and K tiles.
SMALL_TILES = (
    ShrinkConfig(block_m=16, block_k=64, block_r=64, split_k=3),
    ExpandConfig(block_m=16, block_n=64, block_r=16),
)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("h128-qkv-gqa", torch.bfloat16), ("h257-8adapters-qkv", torch.float16), ("h64-long-segment", torch.float32)],
    ids=["h128-qkv-gqa-bf16", "h257-8adapters-qkv-fp16", "h64-long-segment-fp32"],
)
def test_gpu_sized_tiles_match_reference(name, dtype):
    batch = make_batch(CASE[name], dtype, row_align=8).to(DEVICE)
    shrink, expand = SMALL_TILES
    v = triton_sgmv.sgmv_shrink(batch.x, *_args(batch), config=shrink)
    v_ref = reference.sgmv_shrink(batch.x, *_args(batch))
    rtol, atol = V_TOLERANCE
    assert_close(v, v_ref, rtol=rtol, atol=atol)
    y = batch.y.clone()
    triton_sgmv.add_lora(y, batch.x, *_args(batch), shrink=shrink, expand=expand)
    assert_close(y.float(), _expect(batch, v_ref).float(), **y_tolerance(dtype))


def test_configs_a_gpu_would_pick_for_decode_match_reference():
    batch = make_batch(CASE["h1024-8adapters-decode"], torch.bfloat16).to(DEVICE)
    segs = batch.segs
    shrink = shrink_config(
        max_len=segs.max_len,
        num_segments=segs.num_segments,
        num_slices=1,
        in_features=batch.x.shape[1],
        max_rank=segs.max_rank,
        num_sms=132,
        interpret=False,
    )
    expand = expand_config(max_len=segs.max_len, max_width=96, max_rank=segs.max_rank, interpret=False)
    assert shrink.split_k > 1
    y = batch.y.clone()
    triton_sgmv.add_lora(y, batch.x, *_args(batch), shrink=shrink, expand=expand)
    v_ref = reference.sgmv_shrink(batch.x, *_args(batch))
    assert_close(y.float(), _expect(batch, v_ref).float(), **y_tolerance(torch.bfloat16))


def test_more_than_three_slices_are_launched_in_chunks():
    # Four slices (e.g. q/k/v plus a fused extra) exceed one launch; all must still be applied.
    case = CASE["h96-3adapters-gate-up"]
    wide = make_batch(
        type(case)(
            name="four-slices",
            hidden=case.hidden,
            widths=(40, 24, 24, 56),
            lengths=case.lengths,
            slots=case.slots,
            ranks={slot: (*r, r[1], r[0]) for slot, r in case.ranks.items()},
            permute=True,
        ),
        torch.float32,
    ).to(DEVICE)
    assert wide.group.num_slices == 4
    y = wide.y.clone()
    triton_sgmv.add_lora(y, wide.x, *_args(wide))
    v_ref = reference.sgmv_shrink(wide.x, *_args(wide))
    assert_close(y, _expect(wide, v_ref), **y_tolerance(torch.float32))


def test_mismatched_dtypes_are_rejected():
    batch = make_batch(CASE["h64-1adapter-rank1"], torch.float16).to(DEVICE)
    with pytest.raises(ValueError, match="same dtype"):
        triton_sgmv.sgmv_shrink(batch.x.float(), *_args(batch))


def test_cpu_tensors_without_interpreter_get_an_actionable_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = make_batch(CASE["h64-1adapter-rank1"], torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_sgmv.add_lora(batch.y, batch.x, *_args(batch))
