"""Multi-LoRA and paged-attention kernels on a GPU, against torch peers measured in the same run.

    python bench/kernels_gpu.py                   # CUDA: decode sweep at Llama-8B dims
    python bench/kernels_gpu.py --quick           # CUDA: a few shapes
    python bench/kernels_gpu.py --interpret-smoke # CPU: tiny shapes under TRITON_INTERPRET=1

Every row prints time, achieved GB/s (bytes of x, adapter weights touched, y read + write; for
attention q, K and V read, out written), the fraction of this device's copy bandwidth measured in
the same run, and the speedup over a torch peer: gather each token's A/B into stacked tensors then
bmm for LoRA, gather the paged cache then SDPA for attention.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from core.projections import DOWN, GATE_UP, NUM_PROJECTIONS, QKV
from loraplex_kernels.layout import (
    ROW_ALIGN,
    KVGeometry,
    LoraTables,
    Segments,
    SliceGroup,
    kv_cache_views,
)

# Performance targets from issue 3 (memory-bound decode, >= 16 distinct adapters).
TARGET_COPY_FRACTION = 0.60
TARGET_SPEEDUP = 3.0
# A shape is memory-bound when moving its bytes at copy bandwidth takes at least this long;
# below it, kernel launch latency (a few microseconds) dominates whatever the kernel does.
MEMORY_BOUND_US = 10.0
# SDPA reads grouped KV heads itself from torch 2.5 on; older versions need them repeated.
SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class ModelDims:
    """Widths of the adapted projections and the paged KV cache of one model."""

    hidden: int
    kv_dim: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    block_size: int = 16

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


LLAMA_8B = ModelDims(hidden=4096, kv_dim=1024, intermediate=14336, num_heads=32, num_kv_heads=8, num_layers=32)
SMOKE = ModelDims(hidden=64, kv_dim=32, intermediate=96, num_heads=4, num_kv_heads=2, num_layers=2, block_size=8)


@dataclass(frozen=True)
class LoraShape:
    """One decode step of one fused projection group: tokens spread over distinct adapters."""

    group: str  # "qkv" | "gate_up" | "down"
    tokens: int
    adapters: int
    rank: int  # 0: mixed ranks 8/16/32/64 across adapters

    @property
    def label(self) -> str:
        return "mixed" if self.rank == 0 else str(self.rank)


def group_geometry(group: str, dims: ModelDims) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """Projection indices, input width and output widths of a fused group."""
    if group == "qkv":
        return QKV.indices, dims.hidden, (dims.hidden, dims.kv_dim, dims.kv_dim)
    if group == "gate_up":
        return GATE_UP.indices, dims.hidden, (dims.intermediate, dims.intermediate)
    if group == "down":
        return DOWN.indices, dims.intermediate, (dims.hidden,)
    raise ValueError(f"unknown projection group {group!r}")


def adapter_ranks(shape: LoraShape) -> list[int]:
    """Rank of each adapter: the shape's rank, or 8/16/32/64 in turn when mixed."""
    if shape.rank:
        return [shape.rank] * shape.adapters
    return [(8, 16, 32, 64)[i % 4] for i in range(shape.adapters)]


def token_adapters(shape: LoraShape) -> list[int]:
    """Adapter of each token in batch order: round-robin, so every adapter's tokens are scattered."""
    return [t % shape.adapters for t in range(shape.tokens)]


def decode_shapes(quick: bool = False) -> list[LoraShape]:
    """Decode sweep: 1-256 tokens, 1-64 distinct adapters (never more than tokens), ranks 8-64."""
    if quick:
        pairs, ranks, groups = [(16, 16), (64, 64), (256, 64)], [16, 64], ["qkv", "gate_up"]
    else:
        pairs = [(1, 1), (16, 1), (16, 16), (64, 16), (64, 64), (256, 1), (256, 16), (256, 64)]
        ranks, groups = [8, 16, 64, 0], ["qkv", "gate_up", "down"]
    return [LoraShape(g, t, a, r) for g in groups for t, a in pairs for r in ranks]


def lora_bytes(shape: LoraShape, dims: ModelDims, elem_size: int) -> int:
    """Bytes add_lora must move: x once, every used adapter's A and B^T rows once, y read and written."""
    _, in_features, widths = group_geometry(shape.group, dims)
    used = sorted(set(token_adapters(shape)))
    ranks = adapter_ranks(shape)
    weights = sum(ranks[a] for a in used) * len(widths) * in_features + sum(ranks[a] for a in used) * sum(widths)
    return elem_size * (shape.tokens * in_features + weights + 2 * shape.tokens * sum(widths))


def attention_bytes(batch: int, context: int, dims: ModelDims, elem_size: int) -> int:
    """Bytes decode attention must move: q, every cached K and V element of the context, out."""
    kv = 2 * batch * context * dims.num_kv_heads * dims.head_dim
    return elem_size * (kv + 2 * batch * dims.num_heads * dims.head_dim)


def place_rows(widths: list[int], page_elems: int, gen: torch.Generator) -> list[int]:
    """Offsets for rows filled into pages taken from a shuffled free list, as a pool would.

    Rows start at multiples of ``ROW_ALIGN`` and never cross a page; a full page is left for the next.
    """
    pages_needed = sum(-(-w // ROW_ALIGN) * ROW_ALIGN for w in widths) // page_elems + len(widths) // 64 + 2
    free = torch.randperm(2 * pages_needed, generator=gen).tolist()
    offsets, page, used = [], free.pop(), 0
    for width in widths:
        if width > page_elems:
            raise ValueError(f"a {width}-element row does not fit a {page_elems}-element page")
        if used + width > page_elems:
            page, used = free.pop(), 0
        offsets.append(page * page_elems + used)
        used += -(-width // ROW_ALIGN) * ROW_ALIGN
    return offsets


@dataclass
class LoraProblem:
    """Inputs of one fused add_lora call plus the dense stacked weights the torch peer gathers from."""

    x: torch.Tensor
    y: torch.Tensor
    arena: torch.Tensor
    tables: LoraTables
    group: SliceGroup
    segs: Segments
    token_adapter: torch.Tensor  # int64 [tokens]
    a_stacked: list[torch.Tensor]  # per slice [adapters, max_rank, in_features]
    b_stacked: list[torch.Tensor]  # per slice [adapters, max_rank, width]
    scales: torch.Tensor  # fp32 [adapters, slices]


def build_lora(shape: LoraShape, dims: ModelDims, dtype: torch.dtype, device: str, seed: int = 0) -> LoraProblem:
    """Adapters written row by row into a paged arena, tokens sorted into segments by a permutation."""
    gen = torch.Generator().manual_seed(seed)  # placement, on the host
    weights_gen = torch.Generator(device=device).manual_seed(seed)  # values, drawn where they live
    projections, in_features, widths = group_geometry(shape.group, dims)
    ranks = adapter_ranks(shape)
    max_rank = max(ranks)
    geom = KVGeometry(dims.num_layers, dims.num_kv_heads, dims.head_dim, dims.block_size)
    rows = [
        (a, s, kind, i)
        for a in range(shape.adapters)
        for s in range(len(widths))
        for kind in "ab"
        for i in range(ranks[a])
    ]
    row_width = [in_features if kind == "a" else widths[s] for _, s, kind, _ in rows]
    offsets = place_rows(row_width, geom.page_elems, gen)
    num_pages = max(off // geom.page_elems for off in offsets) + 1
    arena = torch.zeros(num_pages * geom.page_elems, dtype=dtype, device=device)
    # Tables are filled on the host (one scalar write per row) and moved once.
    tables = LoraTables.empty(shape.adapters, 1, max_rank, row_align=ROW_ALIGN, num_projections=NUM_PROJECTIONS)
    a_stacked = [torch.zeros(shape.adapters, max_rank, in_features, dtype=dtype, device=device) for _ in widths]
    b_stacked = [torch.zeros(shape.adapters, max_rank, w, dtype=dtype, device=device) for w in widths]
    scales = torch.zeros(shape.adapters, len(widths), dtype=torch.float32)
    for a in range(shape.adapters):
        for s, proj in enumerate(projections):
            r = ranks[a]
            a_rand = torch.randn(r, in_features, generator=weights_gen, device=device)
            b_rand = torch.randn(r, widths[s], generator=weights_gen, device=device)
            a_stacked[s][a, :r] = (a_rand / in_features**0.5).to(dtype)
            b_stacked[s][a, :r] = (b_rand / r**0.5).to(dtype)
            scales[a, s] = 2.0 / r
            tables.ranks[a, 0, proj] = r
            tables.scales[a, 0, proj] = scales[a, s]
    for (a, s, kind, i), offset, width in zip(rows, offsets, row_width, strict=True):
        arena[offset : offset + width] = (a_stacked if kind == "a" else b_stacked)[s][a, i]
        (tables.a_rows if kind == "a" else tables.b_rows)[a, 0, projections[s], i] = offset
    tables = LoraTables(
        a_rows=tables.a_rows.to(device),
        b_rows=tables.b_rows.to(device),
        ranks=tables.ranks.to(device),
        scales=tables.scales.to(device),
        row_align=ROW_ALIGN,
    )
    order = token_adapters(shape)
    index = sorted(range(shape.tokens), key=lambda t: order[t])
    segs = Segments.from_token_slots(
        [order[t] for t in index], dict(enumerate(ranks)), device=device, token_index=index
    )
    return LoraProblem(
        x=torch.randn(shape.tokens, in_features, generator=weights_gen, device=device).to(dtype),
        y=torch.zeros(shape.tokens, sum(widths), dtype=dtype, device=device),
        arena=arena,
        tables=tables,
        group=SliceGroup.contiguous(projections, widths),
        segs=segs,
        token_adapter=torch.tensor(order, dtype=torch.int64, device=device),
        a_stacked=a_stacked,
        b_stacked=b_stacked,
        scales=scales.to(device),
    )


def torch_gather_bmm(p: LoraProblem) -> None:
    """The peer: gather each token's A and B into stacked tensors, then two bmms per slice."""
    x = p.x[:, None, :]
    for s, (offset, width) in enumerate(zip(p.group.out_offsets, p.group.out_widths, strict=True)):
        a = p.a_stacked[s].index_select(0, p.token_adapter)  # [tokens, rank, in]
        b = p.b_stacked[s].index_select(0, p.token_adapter)  # [tokens, rank, width]
        delta = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b)[:, 0].float()
        p.y[:, offset : offset + width] += (delta * p.scales[p.token_adapter, s, None]).to(p.y.dtype)


def time_ms(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds per call; on CUDA with the L2 flushed before every call (cold weights)."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes per second of a large device-to-device copy (read plus write), measured now."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_ms(lambda: dst.copy_(src), device) * 1e-3)


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-6))


@dataclass(frozen=True)
class Timing:
    """One benchmarked shape: our time, the peer's, the bytes moved, and our error against the peer."""

    key: tuple[str | int, ...]  # the table's leading columns
    ms: float
    peer_ms: float
    nbytes: int
    copy_bw: float
    error: float
    adapters: int = 0

    @property
    def copy_fraction(self) -> float:
        return self.nbytes / (self.ms * 1e-3) / self.copy_bw

    @property
    def speedup(self) -> float:
        return self.peer_ms / self.ms

    @property
    def ideal_us(self) -> float:
        """Time to move ``nbytes`` at the measured copy bandwidth."""
        return self.nbytes / self.copy_bw * 1e6


def bench_lora(
    shapes: list[LoraShape], dims: ModelDims, dtype: torch.dtype, device: str, copy_bw: float
) -> list[Timing]:
    """Time the Triton add_lora and the torch peer on every shape; check they agree."""
    from loraplex_kernels import triton_sgmv

    results = []
    for shape in shapes:
        p = build_lora(shape, dims, dtype, device)
        args = (p.arena, p.tables.layer(0), p.group, p.segs)
        triton_sgmv.add_lora(p.y, p.x, *args)
        out = p.y.clone()
        p.y.zero_()
        torch_gather_bmm(p)
        error = _relative_error(out, p.y)
        ours = time_ms(lambda p=p, args=args: triton_sgmv.add_lora(p.y, p.x, *args), device)
        peer = time_ms(lambda p=p: torch_gather_bmm(p), device)
        key = (shape.group, shape.tokens, shape.adapters, shape.label)
        nbytes = lora_bytes(shape, dims, p.x.element_size())
        results.append(Timing(key, ours, peer, nbytes, copy_bw, error, shape.adapters))
        del p
    return results


def bench_attention(
    cases: list[tuple[int, int]], dims: ModelDims, dtype: torch.dtype, device: str, copy_bw: float
) -> list[Timing]:
    """Time Triton paged decode attention and gather + SDPA on equal-length contexts."""
    from loraplex_kernels import triton_attention

    gen = torch.Generator().manual_seed(0)
    device_gen = torch.Generator(device=device).manual_seed(0)
    geom = KVGeometry(1, dims.num_kv_heads, dims.head_dim, dims.block_size)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    results = []
    for batch, context in cases:
        blocks = -(-context // dims.block_size)
        arena = torch.randn(batch * blocks * geom.page_elems, generator=device_gen, device=device).to(dtype)
        k_cache, v_cache = kv_cache_views(arena, geom, 0)
        tables = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).to(device, torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, dims.num_heads, dims.head_dim, generator=device_gen, device=device).to(dtype)
        scale = dims.head_dim**-0.5

        def ours(q=q, k=k_cache, v=v_cache, t=tables, n=lens, scale=scale):
            return triton_attention.paged_attention_decode(q, k, v, t, n, scale)

        def peer(q=q, k=k_cache, v=v_cache, t=tables, context=context, scale=scale):
            keys = k[t.long()].flatten(1, 2)[:, :context].transpose(1, 2)  # [batch, kv_heads, context, dim]
            values = v[t.long()].flatten(1, 2)[:, :context].transpose(1, 2)
            if not SDPA_HAS_GQA:
                group = q.shape[1] // keys.shape[1]
                keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            gqa = {"enable_gqa": True} if SDPA_HAS_GQA else {}
            return sdpa(q[:, :, None], keys, values, scale=scale, **gqa)[:, :, 0]

        error = _relative_error(ours(), peer())
        nbytes = attention_bytes(batch, context, dims, q.element_size())
        results.append(Timing((batch, context), time_ms(ours, device), time_ms(peer, device), nbytes, copy_bw, error))
        del arena, k_cache, v_cache
    return results


def format_table(key_names: tuple[str, ...], peer: str, rows: list[Timing]) -> str:
    """A fixed-width table: the key columns, then time, GB/s, % of copy bandwidth, the peer and the error."""
    widths = [max(len(name), 7) for name in key_names]
    head = " ".join(f"{n:>{w}}" for n, w in zip(key_names, widths, strict=True))
    head += f" {'us':>8} {'GB/s':>7} {'%copy':>6} {peer + ' us':>10} {'x ' + peer:>8} {'err':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = " ".join(f"{k!s:>{w}}" for k, w in zip(r.key, widths, strict=True))
        line += f" {r.ms * 1e3:8.1f} {r.nbytes / r.ms / 1e6:7.0f} {r.copy_fraction:6.0%} {r.peer_ms * 1e3:10.1f}"
        lines.append(line + f" {r.speedup:8.2f} {r.error:8.1e}")
    return "\n".join(lines)


def _stats(rows: list[Timing]) -> str:
    if not rows:
        return "none"
    fractions = [r.copy_fraction for r in rows]
    speedups = [r.speedup for r in rows]
    return (
        f"{len(rows)} shapes, copy bw median {statistics.median(fractions):.0%} min {min(fractions):.0%}, "
        f"speedup median {statistics.median(speedups):.1f}x min {min(speedups):.1f}x"
    )


def summarize(lora: list[Timing], attention: list[Timing], tolerance: float) -> str:
    """One line: LoRA copy-bandwidth fraction and speedup over >= 16-adapter shapes, then attention."""
    many = [r for r in lora if r.adapters >= 16]
    bound = [r for r in many if r.ideal_us >= MEMORY_BOUND_US]
    met = bool(bound) and all(r.copy_fraction >= TARGET_COPY_FRACTION and r.speedup >= TARGET_SPEEDUP for r in bound)
    wrong = sum(r.error > tolerance for r in lora + attention)
    return (
        f"SUMMARY add_lora memory-bound (>=16 adapters, >={MEMORY_BOUND_US:.0f} us at copy bw): {_stats(bound)}; "
        f"all >=16 adapters: {_stats(many)}; target >={TARGET_COPY_FRACTION:.0%} copy bw and "
        f">={TARGET_SPEEDUP:.0f}x torch: {'met' if met else 'NOT met'}; attention vs SDPA: {_stats(attention)}; "
        f"mismatches vs peers: {wrong}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few shapes instead of the whole sweep")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--skip-attention", action="store_true", help="time only the LoRA kernels")
    parser.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="run tiny shapes on CPU under TRITON_INTERPRET=1 to prove the code path (times mean nothing)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code."""
    args = parse_args(argv)
    if args.interpret_smoke:
        # Must happen before triton is first imported (the kernels import it lazily below).
        os.environ["TRITON_INTERPRET"] = "1"
        device, dims, dtype, copy_bytes = "cpu", SMOKE, torch.bfloat16, 1 << 24
        shapes = [LoraShape("qkv", 4, 2, 0), LoraShape("down", 3, 1, 8), LoraShape("gate_up", 1, 1, 16)]
        attention_cases = [(2, 19)]
    else:
        if not torch.cuda.is_available():
            print("bench/kernels_gpu.py needs a CUDA GPU; on CPU run it with --interpret-smoke", file=sys.stderr)
            return 2
        device, dims, dtype, copy_bytes = "cuda", LLAMA_8B, getattr(torch, args.dtype), 1 << 30
        shapes = decode_shapes(args.quick)
        attention_cases = (
            [(1, 8192), (16, 2048), (64, 2048), (256, 1024)]
            if args.quick
            else [(b, c) for b in (1, 8, 32, 128, 256) for c in (512, 2048, 8192)]
        )
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter)"
    copy_bw = copy_bandwidth(device, copy_bytes)
    print(f"device: {name}; dtype {dtype}; copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    tolerance = 3e-2  # max error relative to the largest output, for 16-bit outputs
    lora = bench_lora(shapes, dims, dtype, device, copy_bw)
    print("\nadd_lora (shrink + expand) vs torch gather + bmm")
    print(format_table(("group", "tokens", "adapters", "rank"), "torch", lora))
    attention = [] if args.skip_attention else bench_attention(attention_cases, dims, dtype, device, copy_bw)
    if attention:
        print("\npaged decode attention vs gather + SDPA")
        print(format_table(("batch", "context"), "sdpa", attention))
    print("\n" + summarize(lora, attention, tolerance))
    if args.interpret_smoke:
        print("(interpreter smoke run: the code path works; its times say nothing about a GPU)")
    return 1 if any(r.error > tolerance for r in lora + attention) else 0


if __name__ == "__main__":
    sys.exit(main())
