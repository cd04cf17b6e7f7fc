"""The C loops built without AVX-512 BF16 and AMX, as on CPUs that lack them, still compute bf16 right: the
portable widening (a shift) and rounding paths against fp32 references on the same values."""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Iterator

import pytest
import torch

from core.projections import QKV
from loraplex_kernels import cpu_library, reference, torch_ops
from loraplex_kernels.cpu_linear import GEMM_BF16, PanelWeight, panel_linear
from loraplex_kernels.layout import Segments, SliceGroup
from tests.unit.kernels.test_torch_ops import BF16_TOL, OUT, RANKS, build

WITHOUT = ("-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


@pytest.fixture
def portable_build(tmp_path, monkeypatch) -> Iterator[None]:
    """The library rebuilt (in a fresh cache) by a compiler told the CPU has neither AVX-512 BF16 nor AMX."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C compiler for x86-64")
    wrapper = tmp_path / "cc"
    wrapper.write_text(f'#!/bin/sh\nexec {compiler} "$@" {" ".join(WITHOUT)}\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(tmp_path / "cache"))
    cpu_library.c_library.cache_clear()
    try:
        if cpu_library.c_library() is None:
            pytest.skip("the compiler does not take " + " ".join(WITHOUT))
        yield
    finally:
        cpu_library.c_library.cache_clear()  # later tests load the native build again


def test_bf16_without_avx512_bf16_or_amx_matches_fp32(portable_build):
    gen = torch.Generator().manual_seed(0)
    assert cpu_library.c_library().gemm_amx_ready() == 0
    weight_t, bias = torch.randn(97, 45, generator=gen).bfloat16(), torch.randn(45, generator=gen)
    panels = PanelWeight.pack(weight_t, bias)
    assert panels.kind == GEMM_BF16
    for rows in (1, 5, 8, 9, 40):
        x = torch.randn(rows, 97, generator=gen).bfloat16()
        expected = x.float() @ weight_t.float() + bias
        torch.testing.assert_close(panel_linear(x, panels).float(), expected, rtol=8e-3, atol=1e-2)

    arena, tables = build(RANKS, contiguous=False, dtype=torch.bfloat16, in_features=200)
    segs = Segments.from_token_slots([0, 1, 1, 2, 2, 2, 0, 1, 1, 1, 1, 1], {0: 16, 1: 8, 2: 3})
    group = SliceGroup.contiguous(QKV.indices, OUT)
    x, y = torch.randn(12, 200, generator=gen).bfloat16(), torch.randn(12, sum(OUT), generator=gen).bfloat16()
    expected, got = y.float(), y.clone()
    reference.add_lora(expected, x.float(), arena.float(), tables, group, segs)
    torch_ops.add_lora(got, x, arena, tables, group, segs)
    torch.testing.assert_close(got.float(), expected, **BF16_TOL)

    k_cache, v_cache = torch.randn(2, 12, 16, 2, 64, generator=gen).bfloat16().unbind(0)
    tables = torch.stack([torch.randperm(12, generator=gen)[:4] for _ in range(3)]).to(torch.int32)
    lens = torch.tensor([40, 1, 64], dtype=torch.int32)
    q = torch.randn(3, 8, 64, generator=gen).bfloat16()
    expected = reference.paged_attention_decode(q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.125)
    got = torch_ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), expected, **BF16_TOL)
