"""Dense projections through the C panel GEMM (``cpu_gemm.c``).

Used on CPU in fp32 where the library computes with 512-bit vectors; there it is within 1% of oneDNN's
packed matmul or faster at every row count the engine runs, up to 2x at decode batches of a few tokens
(``bench/linear_cpu.py``), and, unlike oneDNN, keeps no kernel per row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex_kernels.cpu_library import c_library, c_threads

PANEL_COLS = 32  # cpu_gemm.c: PANEL_COLS


@dataclass(frozen=True)
class PanelWeight:
    """``W^T`` (``[in, out]``) as panels of ``PANEL_COLS`` output columns, ``[panels, in, PANEL_COLS]``, the
    last one zero-padded; the bias, if any, padded to whole panels."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    threads: int  # fixed when packed (after the engine set torch's thread count): no lookup per call

    @classmethod
    def pack(cls, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> PanelWeight:
        in_features, out_features = weight_t.shape
        num_panels = -(-out_features // PANEL_COLS)
        padded = weight_t.new_zeros(in_features, num_panels * PANEL_COLS)
        padded[:, :out_features] = weight_t
        panels = padded.view(in_features, num_panels, PANEL_COLS).permute(1, 0, 2).contiguous()
        if bias is not None:
            bias = torch.cat([bias.float(), bias.new_zeros(num_panels * PANEL_COLS - out_features)]).contiguous()
        return cls(panels, bias, in_features, out_features, c_threads())

    def dense_weight_t(self) -> torch.Tensor:
        return self.panels.permute(1, 0, 2).reshape(self.in_features, -1)[:, : self.out_features]

    def num_bytes(self) -> int:
        tensors = [t for t in (self.panels, self.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def panel_gemm_suits(weight_t: torch.Tensor) -> bool:
    """Whether ``weight_t`` should be served by the panel GEMM: CPU fp32, and a library built for AVX-512."""
    if weight_t.device.type != "cpu" or weight_t.dtype != torch.float32:
        return False
    lib = c_library()
    return lib is not None and bool(lib.gemm_uses_avx512())


def panel_linear(x: torch.Tensor, weight: PanelWeight) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for 2-D fp32 ``x`` on CPU."""
    lib = c_library()
    assert lib is not None, "panel weights are only packed where the C library builds"
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    bias = weight.bias.data_ptr() if weight.bias is not None else None
    lib.panel_linear(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0], weight.in_features, weight.out_features,
        weight.panels.data_ptr(), bias, weight.threads,
    )  # fmt: skip
    return y
