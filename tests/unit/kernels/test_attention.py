"""Triton paged decode attention (interpreted on CPU) against the reference and torch SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from loraplex_kernels import reference, torch_ops, triton_attention
from loraplex_kernels.configs import AttentionConfig, attention_config
from loraplex_kernels.layout import KVGeometry, kv_cache_views

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (rtol, atol) on outputs of order one. fp32 differs from the reference only in summation order;
# 16-bit outputs are rounded once on store and the kernel rounds probabilities to the cache dtype
# before P @ V (as flash attention does): about two units in the last place.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _tol(dtype: torch.dtype) -> dict[str, float]:
    rtol, atol = TOLERANCE[dtype]
    return {"rtol": rtol, "atol": atol}


def _paged_batch(block_size, num_kv_heads, group, head_dim, lengths, dtype, seed=0):
    """Random q and a two-layer arena whose layer-1 KV views hold each sequence in scattered pages."""
    gen = torch.Generator().manual_seed(seed)
    geom = KVGeometry(num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    max_blocks = max(-(-n // block_size) for n in lengths) + 1  # one spare column past every context
    num_pages = len(lengths) * max_blocks + 3
    arena = torch.randn(num_pages * geom.page_elems, generator=gen).to(dtype)
    k_cache, v_cache = kv_cache_views(arena.to(DEVICE), geom, layer=1)
    pages = torch.randperm(num_pages, generator=gen)[: len(lengths) * max_blocks]
    block_tables = pages.view(len(lengths), max_blocks).to(torch.int32)
    q = torch.randn(len(lengths), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    return q.to(DEVICE), k_cache, v_cache, block_tables.to(DEVICE), context_lens.to(DEVICE)


def _sdpa(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, softcap=None):
    """Float64 SDPA per sequence on K/V gathered from its pages (the last ``window`` of them with a window);
    zeros for an empty context. With ``softcap``, scaled scores ``s`` become ``softcap * tanh(s / softcap)``."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        first = 0 if window is None else max(0, n - window)
        pages = block_tables[b].long()
        keys = k_cache[pages].flatten(0, 1)[first:n].double().cpu().repeat_interleave(group, dim=1)
        values = v_cache[pages].flatten(0, 1)[first:n].double().cpu().repeat_interleave(group, dim=1)
        query = q[b].double().cpu()[:, None, :]  # [heads, 1, head_dim]
        if softcap is not None:  # as transformers' eager Gemma 2 attention: cap, then softmax
            scores = torch.tanh(query @ keys.permute(1, 2, 0) * scale / softcap) * softcap
            out[b] = (torch.softmax(scores, dim=-1) @ values.transpose(0, 1)).squeeze(1)
            continue
        out[b] = F.scaled_dot_product_attention(
            query, keys.transpose(0, 1), values.transpose(0, 1), scale=scale
        ).squeeze(1)
    return out


# block_size, num_kv_heads, group (GQA ratio), head_dim, ragged context lengths (0 and 1 included)
SHAPES = [
    (16, 2, 1, 64, (0, 1, 17, 64, 100)),
    (8, 2, 2, 32, (5, 0, 33, 96)),
    (32, 1, 4, 64, (1, 31, 32, 33, 150)),
    (1, 1, 8, 16, (3, 1, 12)),
    (16, 2, 8, 40, (70, 0, 16, 9)),
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _shape_id(shape, dtype) -> str:
    block_size, num_kv_heads, group, head_dim, _ = shape
    return f"block{block_size}-kv{num_kv_heads}-gqa{group}-d{head_dim}-{str(dtype).removeprefix('torch.')}"


# Each shape in one dtype (cycling through all three), plus two shapes in a second dtype.
ATTENTION_CASES = [(shape, DTYPES[i % 3]) for i, shape in enumerate(SHAPES)]
ATTENTION_CASES += [(SHAPES[0], torch.float16), (SHAPES[2], torch.float32)]


@pytest.mark.parametrize(("shape", "dtype"), [pytest.param(*c, id=_shape_id(*c)) for c in ATTENTION_CASES])
@pytest.mark.parametrize("split", [False, True], ids=["one-partition", "partitions"])
def test_decode_matches_reference_and_sdpa(shape, dtype, split):
    block_size, num_kv_heads, group, head_dim, lengths = shape
    inputs = _paged_batch(block_size, num_kv_heads, group, head_dim, lengths, dtype)
    assert not inputs[1].is_contiguous()  # the kernel must honour the arena's strides
    scale = head_dim**-0.5
    # Partitions of 32 tokens in 16-token tiles: every long context is split and merged.
    config = AttentionConfig(block_n=16, partition=32) if split else None
    out = triton_attention.paged_attention_decode(*inputs, scale, config=config)
    expected = reference.paged_attention_decode(*inputs, scale)
    assert out.dtype == dtype
    assert_close(out.float(), expected.float(), **_tol(dtype))
    assert_close(out.double().cpu(), _sdpa(*inputs, scale), **_tol(dtype))


@pytest.mark.parametrize("window", [None, 1, 16, 21, 77, 500])
def test_reference_matches_sdpa_in_fp32(window):
    inputs = _paged_batch(16, 2, 4, 32, (0, 1, 40, 77), torch.float32)
    expected = _sdpa(*inputs, 0.2, window)
    got = reference.paged_attention_decode(*inputs, 0.2, window)
    assert_close(got.double().cpu(), expected, rtol=1e-5, atol=1e-6)


# block_size, num_kv_heads, group, head_dim, context lengths, window: windows that start mid-page and span
# page boundaries, one page long (page-aligned and not), of one token, and longer than every context (no-op).
WINDOW_CASES = [
    ((16, 2, 4, 32, (0, 1, 17, 40, 100), 24), torch.float32),
    ((8, 1, 8, 16, (5, 9, 33, 64), 8), torch.bfloat16),
    ((4, 2, 2, 32, (7, 13, 50), 1), torch.float16),
    ((16, 2, 1, 64, (3, 16, 30), 64), torch.float32),
]


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [pytest.param(shape, dtype, id=f"{_shape_id(shape[:5], dtype)}-window{shape[5]}") for shape, dtype in WINDOW_CASES],
)
@pytest.mark.parametrize("split", [False, True], ids=["one-partition", "partitions"])
def test_sliding_window_decode_matches_reference_and_sdpa(shape, dtype, split):
    """Only the last ``window`` tokens are read; partitions wholly before the window are left out of the merge."""
    *geometry, lengths, window = shape
    inputs = _paged_batch(*geometry, lengths, dtype, seed=1)
    scale = geometry[3] ** -0.5
    config = AttentionConfig(block_n=16, partition=32) if split else None
    out = triton_attention.paged_attention_decode(*inputs, scale, window, config=config)
    expected = reference.paged_attention_decode(*inputs, scale, window)
    assert_close(out.float(), expected.float(), **_tol(dtype))
    assert_close(out.double().cpu(), _sdpa(*inputs, scale, window), **_tol(dtype))
    full = triton_attention.paged_attention_decode(*inputs, scale, config=config)
    for b, n in enumerate(lengths):
        assert torch.equal(out[b], full[b]) == (n <= window), (n, window)  # a window past the context: no-op


# block_size, num_kv_heads, group, head_dim, context lengths, window (None: full attention)
SOFTCAP_CASES = [
    ((16, 2, 4, 32, (0, 1, 17, 40, 100), None), torch.float32),
    ((8, 1, 8, 16, (5, 9, 33, 64), 8), torch.float32),
    ((16, 2, 2, 32, (7, 13, 50), 24), torch.bfloat16),
]


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        pytest.param(shape, dtype, id=f"{_shape_id(shape[:5], dtype)}-window{shape[5]}")
        for shape, dtype in SOFTCAP_CASES
    ],
)
@pytest.mark.parametrize("split", [False, True], ids=["one-partition", "partitions"])
def test_softcapped_decode_matches_reference_torch_and_sdpa(shape, dtype, split, monkeypatch):
    """Gemma 2's attention logit soft-capping: every kernel caps the scaled scores before the softmax.

    Scale 1 on unit-normal q and k gives scores of several units, so a cap of 3 changes every output."""
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL_THREADS", "2")
    *geometry, lengths, window = shape
    inputs = _paged_batch(*geometry, lengths, dtype, seed=2)
    scale, softcap = 1.0, 3.0
    config = AttentionConfig(block_n=16, partition=32) if split else None
    out = triton_attention.paged_attention_decode(*inputs, scale, window, softcap, config=config)
    expected = reference.paged_attention_decode(*inputs, scale, window, softcap)
    assert_close(out.float(), expected.float(), **_tol(dtype))
    assert_close(out.double().cpu(), _sdpa(*inputs, scale, window, softcap), **_tol(dtype))
    uncapped = reference.paged_attention_decode(*inputs, scale, window)
    assert (expected - uncapped).abs().max() > 0.1
    if dtype == torch.float32 and DEVICE == "cpu":
        loops = torch_ops.c_loops()
        assert loops is not None, "the C loop should build here (a C compiler is installed)"
        for with_loops in (loops, None):  # the C loop, and the vectorised torch ops
            got = torch_ops.paged_attention_decode_with(with_loops, *inputs, scale, window, softcap)
            assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_config_a_gpu_would_pick_for_a_small_batch_matches_reference():
    inputs = _paged_batch(16, 1, 4, 32, (300, 5), torch.bfloat16)
    config = attention_config(
        batch=2, num_kv_heads=1, max_context=inputs[3].shape[1] * 16, num_sms=132, interpret=False
    )
    assert config.num_partitions(inputs[3].shape[1] * 16) > 1
    out = triton_attention.paged_attention_decode(*inputs, 0.125, config=config)
    assert_close(out.float(), reference.paged_attention_decode(*inputs, 0.125).float(), **_tol(torch.bfloat16))


def test_query_and_cache_dtypes_must_match():
    q, k_cache, v_cache, block_tables, context_lens = _paged_batch(16, 1, 1, 16, (3,), torch.float16)
    with pytest.raises(ValueError, match="share a dtype"):
        triton_attention.paged_attention_decode(q.float(), k_cache, v_cache, block_tables, context_lens, 1.0)
