"""``LORAPLEX_KERNELS`` routes the public kernel functions to the Triton implementations."""

from __future__ import annotations

import pytest
import torch

import loraplex_kernels as kernels
from loraplex_kernels import triton_attention, triton_sgmv
from tests.unit.kernels.cases import make_batch
from tests.unit.kernels.sweep import CASES


def test_forcing_triton_runs_the_triton_kernels(monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    batch = make_batch(CASES[2], torch.bfloat16)
    args = (batch.x, batch.packed.arena, batch.packed.layer_tables(), batch.group, batch.segs)
    assert kernels.backend_for(torch.device("cpu")) == "triton"
    y_public, y_triton = batch.y.clone(), batch.y.clone()
    kernels.add_lora(y_public, *args)
    triton_sgmv.add_lora(y_triton, *args)
    assert torch.equal(y_public, y_triton)
    assert not torch.equal(y_public, batch.y)


def test_forcing_triton_routes_attention(monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    geom = kernels.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=16, block_size=4)
    k_cache, v_cache = kernels.kv_cache_views(torch.randn(3 * geom.page_elems), geom, 0)
    q = torch.randn(2, 2, 16)
    tables = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32)
    lens = torch.tensor([7, 3], dtype=torch.int32)
    out = kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25)
    assert torch.equal(out, triton_attention.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25))


def test_unknown_backend_is_rejected(monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "cuda")
    with pytest.raises(ValueError, match="LORAPLEX_KERNELS"):
        kernels.backend_for(torch.device("cpu"))
