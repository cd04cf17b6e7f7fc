"""Pieces shared by the Triton kernels: an interpreter-safe ``tl.dot`` and launch checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex_kernels.configs import interpreting
from loraplex_kernels.interpreter_compat import patch_interpreter_index

if interpreting():
    patch_interpreter_index()


@triton.jit
def dot(a, b, INTERPRET: tl.constexpr):
    """``a @ b`` accumulated in fp32; ``ieee`` keeps fp32 operands off TF32 (ignored for 16-bit)."""
    if INTERPRET:
        # The interpreter multiplies bf16 as its raw uint16 bits; widening keeps the values exact.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


def check_paged_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise unless ``q`` ``[rows, heads, d]`` can attend over K/V caches ``[pages, block_size, kv_heads, d]``."""
    if k_cache.shape[-1] != q.shape[-1] or v_cache.shape != k_cache.shape or q.shape[1] % k_cache.shape[2]:
        raise ValueError("caches must be [pages, block_size, kv_heads, head_dim] with kv_heads dividing num_heads")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")


def check_launchable(*tensors: torch.Tensor, interpret: bool | None = None) -> bool:
    """Raise unless every tensor can reach a Triton kernel; return whether the interpreter runs it.

    ``interpret`` is what the caller decided once (a backend); None reads ``TRITON_INTERPRET`` now."""
    if interpret is None:
        interpret = interpreting()
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"kernel inputs must share one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 before triton is "
            "imported to run them on CPU, or use LORAPLEX_KERNELS=torch"
        )
    return interpret
