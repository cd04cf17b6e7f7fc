"""Launch configurations: legal tiles for tl.dot, K splits that cover K exactly, partitions that fit."""

from __future__ import annotations

import pytest

from loraplex_kernels.configs import MIN_DOT, attention_config, cdiv, expand_config, next_pow2, shrink_config

H100_SMS = 132


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("max_len", [1, 7, 16, 300, 4096])
@pytest.mark.parametrize(("in_features", "max_rank"), [(64, 1), (257, 16), (4096, 64), (14336, 8), (4096, 128)])
def test_shrink_tiles_are_legal_and_splits_cover_k_exactly(interpret, max_len, in_features, max_rank):
    cfg = shrink_config(
        max_len=max_len,
        num_segments=16,
        num_slices=3,
        in_features=in_features,
        max_rank=max_rank,
        num_sms=H100_SMS,
        interpret=interpret,
    )
    for block in (cfg.block_m, cfg.block_k, cfg.block_r):
        assert block >= MIN_DOT and block == next_pow2(block)
    assert cfg.block_r >= max_rank  # the shrink holds a whole rank in one tile
    per_split = cfg.k_per_split(in_features)
    assert per_split % cfg.block_k == 0
    assert cdiv(in_features, per_split) == cfg.split_k, "every split must own at least one K tile"


def test_decode_shrink_splits_k_to_fill_the_gpu_and_prefill_does_not():
    common = {"num_slices": 3, "in_features": 4096, "max_rank": 16, "num_sms": H100_SMS, "interpret": False}
    decode = shrink_config(max_len=1, num_segments=16, **common)
    prefill = shrink_config(max_len=4096, num_segments=4, **common)
    assert decode.split_k > 1
    assert cdiv(1, decode.block_m) * 16 * 3 * decode.split_k >= 2 * H100_SMS
    assert prefill.split_k == 1 and prefill.block_m == 64
    assert shrink_config(max_len=1, num_segments=16, **{**common, "interpret": True}).split_k == 1


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize(("max_len", "max_width", "max_rank"), [(1, 1024, 8), (5, 14336, 64), (512, 33, 128)])
def test_expand_tiles_are_legal(interpret, max_len, max_width, max_rank):
    cfg = expand_config(max_len=max_len, max_width=max_width, max_rank=max_rank, interpret=interpret)
    for block in (cfg.block_m, cfg.block_n, cfg.block_r):
        assert block >= MIN_DOT and block == next_pow2(block)
    assert cfg.block_n <= max(next_pow2(max_width), MIN_DOT)


@pytest.mark.parametrize(("batch", "max_context"), [(1, 8192), (4, 300), (256, 4096), (3, 0), (64, 16)])
def test_attention_partitions_are_whole_tiles_and_only_split_small_batches(batch, max_context):
    cfg = attention_config(batch=batch, num_kv_heads=8, max_context=max_context, num_sms=H100_SMS, interpret=False)
    assert cfg.partition % cfg.block_n == 0 and cfg.block_n >= MIN_DOT
    partitions = cfg.num_partitions(max_context)
    assert (partitions - 1) * cfg.partition < max(max_context, 1), "no partition may start past every context"
    if batch * 8 >= 4 * H100_SMS:
        assert partitions == 1
    if (batch, max_context) == (1, 8192):
        assert partitions > 1
