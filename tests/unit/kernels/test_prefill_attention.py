"""Triton varlen paged prefill attention (interpreted on CPU) against the reference and the engine's SDPA path.

A step mixes first prompt chunks, later chunks whose earlier tokens sit in scattered pages, and decode rows;
every key, old or new, is read from the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.testing import assert_close

from loraplex_kernels import TorchBackend, TritonBackend, reference, triton_prefill
from loraplex_kernels.configs import MIN_DOT, PrefillConfig, next_pow2, prefill_config
from loraplex_kernels.layout import KVGeometry, kv_cache_views
from server.model.attention import AttentionMetadata, PrefillSpan, VarlenSpans, paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (rtol, atol) on outputs of order one, as the decode kernel's tests: fp32 differs only in summation order; 16-bit
# outputs are rounded on store and probabilities are rounded to the cache dtype before P @ V. The engine's SDPA
# path computes 16-bit attention in its own order, so it gets twice the slack.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _tol(dtype: torch.dtype, slack: float = 1.0) -> dict[str, float]:
    rtol, atol = TOLERANCE[dtype]
    return {"rtol": rtol * slack, "atol": atol * slack}


@dataclass
class Step:
    """One step's queries and the caches already holding every sequence's keys, old and new."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    spans: VarlenSpans

    def args(self) -> tuple:
        s = self.spans
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            s.query_starts,
            s.query_lens,
            s.context_lens,
            s.block_tables,
            s.max_query_len,
        )


def _step(num_kv_heads, group, head_dim, seqs, dtype, block_size=16, seed=0) -> Step:
    """``seqs``: (tokens cached before the step, new tokens) per sequence. Pages are shuffled across sequences and
    the caches are layer-1 views of a two-layer arena (strided, as the engine's)."""
    gen = torch.Generator().manual_seed(seed)
    geom = KVGeometry(num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    width = max(-(-(c + n) // block_size) for c, n in seqs) + 1  # a spare column past every sequence
    num_pages = len(seqs) * width + 3
    arena = torch.randn(num_pages * geom.page_elems, generator=gen).to(dtype)
    k_cache, v_cache = kv_cache_views(arena.to(DEVICE), geom, layer=1)
    pages = torch.randperm(num_pages, generator=gen)[: len(seqs) * width]
    lens = [n for _, n in seqs]
    starts = [sum(lens[:i]) for i in range(len(seqs))]
    q = torch.randn(sum(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    spans = VarlenSpans(
        query_starts=ints(starts),
        query_lens=ints(lens),
        context_lens=ints([c for c, _ in seqs]),
        block_tables=pages.view(len(seqs), width).to(torch.int32).to(DEVICE),
        max_query_len=max(lens),
    )
    return Step(q.to(DEVICE), k_cache, v_cache, spans)


def _sdpa_path(step: Step, scale: float, window=None, softcap=None) -> torch.Tensor:
    """The engine's per-span path (``paged_attention`` with the torch backend): SDPA per prompt chunk, the decode
    kernel for single rows."""
    s = step.spans
    block_size = step.k_cache.shape[1]
    starts, lens, contexts = s.query_starts.tolist(), s.query_lens.tolist(), s.context_lens.tolist()
    # The step's own keys, as the layer computed them before writing them into the cache.
    keys, values = [], []
    for b, (context, n) in enumerate(zip(contexts, lens, strict=True)):
        positions = torch.arange(context, context + n, device=DEVICE)
        pages = s.block_tables[b].long()[positions // block_size]
        keys.append(step.k_cache[pages, positions % block_size])
        values.append(step.v_cache[pages, positions % block_size])
    decodes = [b for b, n in enumerate(lens) if n == 1]
    index = torch.tensor(decodes, dtype=torch.long, device=DEVICE)
    meta = AttentionMetadata(
        write_pages=torch.empty(0),
        write_offsets=torch.empty(0),
        prefills=[
            PrefillSpan(start, n, context, s.block_tables[b])
            for b, (start, n, context) in enumerate(zip(starts, lens, contexts, strict=True))
            if n > 1
        ],
        decode_rows=index.new_tensor([starts[b] for b in decodes]) if decodes else None,
        decode_block_tables=s.block_tables[index] if decodes else None,
        decode_context_lens=s.context_lens[index] + 1 if decodes else None,
        all_decode=False,
    )
    kernels = TorchBackend(torch.device(DEVICE), step.q.dtype)
    k, v = torch.cat(keys), torch.cat(values)
    return paged_attention(step.q, k, v, step.k_cache, step.v_cache, meta, scale, kernels, window, softcap)


# (tokens cached before the step, new tokens) per sequence: a first chunk, a decode row, a later chunk that starts
# mid-page and crosses pages, a short later chunk after two pages, a one-token prompt (a decode row with nothing
# cached), a chunk starting exactly on a page boundary.
MIXED = ((0, 20), (17, 1), (5, 33), (40, 7), (0, 1), (32, 9))

# num_kv_heads, group (GQA ratio), head_dim, window, softcap, dtype. Windows shorter than a chunk (8, 5) and
# longer than every chunk but shorter than the longest context (30); softcap alone and with a window.
CASES = [
    (2, 1, 32, None, None, torch.float32),
    (2, 2, 16, 8, None, torch.float32),
    (1, 4, 80, 30, 3.0, torch.float32),
    (2, 4, 32, None, 3.0, torch.bfloat16),
    (1, 2, 64, 5, None, torch.bfloat16),
    (2, 1, 48, 30, None, torch.float16),
]


def _case_id(case) -> str:
    kv, group, head_dim, window, softcap, dtype = case
    return f"kv{kv}-gqa{group}-d{head_dim}-window{window}-softcap{softcap}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in CASES])
@pytest.mark.parametrize("tiles", ["one-tile", "small-tiles"])
def test_mixed_step_matches_reference_and_sdpa_path(case, tiles):
    """Small tiles split every chunk into several query tiles and its context into several key tiles, so windows
    and the causal diagonal cross tile boundaries; one tile per sequence is what the interpreter picks itself."""
    num_kv_heads, group, head_dim, window, softcap, dtype = case
    step = _step(num_kv_heads, group, head_dim, MIXED, dtype)
    assert not step.k_cache.is_contiguous()  # the kernel must honour the arena's strides
    scale = 1.0 if softcap else head_dim**-0.5  # scores of several units, so a cap of 3 changes every row
    config = PrefillConfig(block_q=max(1, MIN_DOT // next_pow2(group)), block_n=16) if tiles == "small-tiles" else None
    out = triton_prefill.paged_attention_prefill(*step.args(), scale, window, softcap, config=config)
    expected = reference.paged_attention_prefill(*step.args(), scale, window, softcap)
    assert out.dtype == dtype
    assert_close(out.float(), expected.float(), **_tol(dtype))
    assert_close(out.float(), _sdpa_path(step, scale, window, softcap).float(), **_tol(dtype, slack=2))
    if window is not None or softcap is not None:  # the case is not plain causal attention in disguise
        plain = reference.paged_attention_prefill(*step.args(), scale)
        assert (expected.float() - plain.float()).abs().max() > 0.1


def test_reference_matches_sdpa_path_in_fp32():
    step = _step(2, 2, 32, MIXED, torch.float32, seed=3)
    for window, softcap in ((None, None), (1, None), (8, 2.0), (100, None)):
        expected = _sdpa_path(step, 0.3, window, softcap)
        got = reference.paged_attention_prefill(*step.args(), 0.3, window, softcap)
        assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_only_decode_rows_match_the_decode_reference():
    """A step of single rows is decode attention over ``context + 1`` tokens (the new one included)."""
    seqs = ((3, 1), (16, 1), (0, 1), (45, 1))
    step = _step(2, 4, 32, seqs, torch.float32, block_size=8, seed=4)
    s = step.spans
    out = triton_prefill.paged_attention_prefill(*step.args(), 0.2, 10)
    expected = reference.paged_attention_decode(
        step.q, step.k_cache, step.v_cache, s.block_tables, s.context_lens + 1, 0.2, 10
    )
    assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_config_a_gpu_would_pick_matches_reference():
    """128-row query tiles and 64-key tiles, as on an H100 (run here under the interpreter)."""
    step = _step(1, 2, 64, ((0, 70), (100, 1), (20, 130)), torch.bfloat16, seed=5)
    config = prefill_config(
        max_query_len=130, group=2, head_dim=64, max_context=step.spans.block_tables.shape[1] * 16, interpret=False
    )
    assert config.block_q * 2 == 128 and config.block_n == 64
    out = triton_prefill.paged_attention_prefill(*step.args(), 0.125, 50, config=config)
    expected = reference.paged_attention_prefill(*step.args(), 0.125, 50)
    assert_close(out.float(), expected.float(), **_tol(torch.bfloat16))


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("max_query_len", [1, 5, 16, 300, 8192])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (2, 80), (4, 128), (8, 128), (16, 256), (32, 64)])
def test_prefill_tiles_are_legal(interpret, max_query_len, group, head_dim):
    cfg = prefill_config(
        max_query_len=max_query_len, group=group, head_dim=head_dim, max_context=4096, interpret=interpret
    )
    block_m = cfg.block_q * next_pow2(group)
    assert block_m >= MIN_DOT and cfg.block_n >= MIN_DOT  # tl.dot's smallest tile
    for block in (cfg.block_q, cfg.block_n):
        assert block == next_pow2(block)
    assert block_m <= max(128, next_pow2(group))  # the fp32 accumulator stays within registers


def test_engine_dispatches_a_step_with_prompt_chunks_to_one_varlen_launch():
    """``paged_attention`` hands a step with ``meta.varlen`` to the backend's varlen kernel, in one call."""
    step = _step(2, 2, 32, MIXED, torch.float32, seed=6)
    backend = TritonBackend(torch.device(DEVICE))
    assert backend.varlen_prefill and not TorchBackend(torch.device(DEVICE), torch.float32).varlen_prefill
    calls = []
    launch = backend.paged_attention_prefill

    def counted(*args, **kwargs):
        calls.append(args)
        return launch(*args, **kwargs)

    backend.paged_attention_prefill = counted
    meta = AttentionMetadata(
        write_pages=torch.empty(0),
        write_offsets=torch.empty(0),
        prefills=[],
        decode_rows=None,
        decode_block_tables=None,
        decode_context_lens=None,
        all_decode=False,
        varlen=step.spans,
    )
    unused = step.q[:0]  # the step's own keys: the varlen kernel reads them back from the cache
    out = paged_attention(step.q, unused, unused, step.k_cache, step.v_cache, meta, 0.25, backend, 8, 2.0)
    assert len(calls) == 1
    assert_close(out, _sdpa_path(step, 0.25, 8, 2.0), rtol=1e-5, atol=1e-5)


def test_query_and_cache_dtypes_must_match():
    step = _step(1, 1, 16, ((0, 3),), torch.float16)
    with pytest.raises(ValueError, match="share a dtype"):
        triton_prefill.paged_attention_prefill(step.q.float(), *step.args()[1:], 1.0)
