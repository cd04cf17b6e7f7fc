"""The kernel backend is chosen once, from the device, the dtype and ``LORAPLEX_KERNELS``, and runs the
implementation it names; a step's segments must be prepared before its LoRA calls."""

from __future__ import annotations

import pytest
import torch

import loraplex_kernels as kernels
from loraplex_kernels import (
    TorchBackend,
    TritonBackend,
    reference,
    select_backend,
    torch_ops,
    triton_attention,
    triton_sgmv,
)
from tests.unit.kernels.cases import make_batch
from tests.unit.kernels.sweep import CASES

CPU = torch.device("cpu")
# Triton runs on the GPU when there is one, else under the interpreter (tests/conftest.py turns it on).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _attention_inputs(device: torch.device = CPU):
    geom = kernels.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=16, block_size=4)
    k_cache, v_cache = kernels.kv_cache_views(torch.randn(3 * geom.page_elems, device=device), geom, 0)
    q = torch.randn(2, 2, 16, device=device)
    tables = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32, device=device)
    lens = torch.tensor([7, 3], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, lens, 0.25


def test_forcing_triton_runs_the_triton_kernels(monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    backend = select_backend(TRITON_DEVICE, torch.bfloat16)
    assert isinstance(backend, TritonBackend) and backend.name == "triton"
    batch = make_batch(CASES[2], torch.bfloat16).to(TRITON_DEVICE)
    args = (batch.x, batch.packed.arena, batch.packed.layer_tables(), batch.group, batch.segs)
    y_backend, y_triton = batch.y.clone(), batch.y.clone()
    backend.prepare(batch.segs)
    backend.add_lora(y_backend, *args)
    triton_sgmv.add_lora(y_triton, *args)
    assert torch.equal(y_backend, y_triton)
    assert not torch.equal(y_backend, batch.y)
    inputs = _attention_inputs(TRITON_DEVICE)
    assert torch.equal(backend.paged_attention_decode(*inputs), triton_attention.paged_attention_decode(*inputs))
    windowed = backend.paged_attention_decode(*inputs, window=3)
    assert torch.equal(windowed, triton_attention.paged_attention_decode(*inputs, 3))
    capped = backend.paged_attention_decode(*inputs, window=3, softcap=0.5)
    assert torch.equal(capped, triton_attention.paged_attention_decode(*inputs, 3, 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_on_cpu_is_torch_with_the_c_loops_in_fp32_and_bf16(monkeypatch, dtype):
    monkeypatch.delenv("LORAPLEX_KERNELS", raising=False)
    backend = select_backend(CPU, dtype)
    assert isinstance(backend, TorchBackend)
    assert (backend.loops is not None) == (dtype != torch.float16 and torch_ops.c_loops() is not None)
    batch = make_batch(CASES[2], dtype)
    tables = batch.packed.layer_tables()
    y_backend, y_expected = batch.y.clone(), batch.y.clone()
    backend.prepare(batch.segs)
    backend.add_lora(y_backend, batch.x, batch.packed.arena, tables, batch.group, batch.segs)
    reference.add_lora(y_expected, batch.x, batch.packed.arena, tables, batch.group, batch.segs)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(y_backend, y_expected, rtol=tol, atol=tol)
    inputs = _attention_inputs()
    torch.testing.assert_close(backend.paged_attention_decode(*inputs), reference.paged_attention_decode(*inputs))
    torch.testing.assert_close(
        backend.paged_attention_decode(*inputs, window=3), reference.paged_attention_decode(*inputs, 3)
    )
    torch.testing.assert_close(
        backend.paged_attention_decode(*inputs, softcap=0.5), reference.paged_attention_decode(*inputs, None, 0.5)
    )


def test_the_choice_is_read_once_at_construction(monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    backend = select_backend(CPU, torch.float32)
    monkeypatch.setenv("LORAPLEX_KERNELS", "not-a-backend")  # later changes reach no existing backend
    batch = make_batch(CASES[2], torch.float32)
    backend.prepare(batch.segs)
    backend.add_lora(batch.y.clone(), batch.x, batch.packed.arena, batch.packed.layer_tables(), batch.group, batch.segs)
    assert isinstance(select_backend(CPU, torch.float32, "torch"), TorchBackend)  # an explicit choice wins


@pytest.mark.parametrize("value", ["cuda", "Triton2", "c"])
def test_unknown_backend_is_rejected_with_the_choices(monkeypatch, value):
    monkeypatch.setenv("LORAPLEX_KERNELS", value)
    with pytest.raises(ValueError, match="LORAPLEX_KERNELS must be one of auto, torch, triton"):
        select_backend(CPU, torch.float32)


def test_triton_on_cpu_without_the_interpreter_is_refused_when_built(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend(CPU, torch.float32, "triton")


@pytest.mark.parametrize("choice", ["torch", "triton"])
def test_lora_calls_need_the_steps_segments_prepared(choice):
    device = TRITON_DEVICE if choice == "triton" else CPU
    backend = select_backend(device, torch.float32, choice)
    batch = make_batch(CASES[2], torch.float32).to(device)
    args = (batch.y, batch.x, batch.packed.arena, batch.packed.layer_tables(), batch.group, batch.segs)
    with pytest.raises(ValueError, match="prepare"):
        backend.add_lora(*args)
    backend.prepare(batch.segs)
    backend.add_lora(*args)
    backend.prepare(make_batch(CASES[2], torch.float32).to(device).segs)  # the next step: the old segments are stale
    with pytest.raises(ValueError, match="prepare"):
        backend.add_lora(*args)
