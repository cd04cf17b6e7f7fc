"""Dense projections through the C panel GEMM (``cpu_gemm.c``).

Used on CPU in fp32 where the library computes with 512-bit vectors; there it is as fast as oneDNN's packed
matmul or faster at every row count the engine runs: 1.24-1.37x at decode batches of 16-64 rows, 1.27-1.48x at
a few rows (``bench/linear_cpu.py``, one thread), and, unlike oneDNN, keeps no kernel per row count. In bf16 it is
used wherever the library builds: panels hold pairs of input rows interleaved (``cpu_gemm.c``), fp32
accumulation, through AMX tiles where the CPU and kernel offer them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex_kernels.cpu_library import c_library, c_threads

PANEL_COLS = 32  # cpu_gemm.c: PANEL_COLS
GEMM_FP32, GEMM_BF16, GEMM_BF16_AMX = 0, 1, 2  # cpu_gemm.c: the kinds of panel_linear


@dataclass(frozen=True)
class PanelWeight:
    """``W^T`` (``[in, out]``) as panels of ``PANEL_COLS`` output columns, ``[panels, in, PANEL_COLS]``, the
    last one zero-padded; the bias, if any, fp32 and padded to whole panels. In bf16 each panel is
    ``[ceil(in / 2), PANEL_COLS, 2]``: input rows ``2i`` and ``2i + 1`` interleaved (an odd last one with zeros)."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    threads: int  # fixed when packed (after the engine set torch's thread count): no lookup per call
    kind: int  # GEMM_*: how cpu_gemm.c computes with these panels

    @classmethod
    def pack(cls, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> PanelWeight:
        in_features, out_features = weight_t.shape
        num_panels = -(-out_features // PANEL_COLS)
        pair = 2 if weight_t.dtype == torch.bfloat16 else 1
        padded = weight_t.new_zeros(-(-in_features // pair) * pair, num_panels * PANEL_COLS)
        padded[:in_features, :out_features] = weight_t
        panels = padded.view(-1, pair, num_panels, PANEL_COLS).permute(2, 0, 3, 1).contiguous()
        panels = panels.view(num_panels, -1, PANEL_COLS) if pair == 1 else panels
        if bias is not None:
            bias = bias.float()
            bias = torch.cat([bias, bias.new_zeros(num_panels * PANEL_COLS - out_features)]).contiguous()
        if pair == 1:
            kind = GEMM_FP32
        else:
            lib = c_library()
            kind = GEMM_BF16_AMX if lib is not None and lib.gemm_amx_ready() else GEMM_BF16
        return cls(panels, bias, in_features, out_features, c_threads(), kind)

    def dense_weight_t(self) -> torch.Tensor:
        if self.panels.dim() == 4:  # bf16 pairs: [panels, in / 2, PANEL_COLS, 2]
            return self.panels.permute(1, 3, 0, 2).reshape(-1, self.panels.shape[0] * PANEL_COLS)[
                : self.in_features, : self.out_features
            ]
        return self.panels.permute(1, 0, 2).reshape(self.in_features, -1)[:, : self.out_features]

    def num_bytes(self) -> int:
        tensors = [t for t in (self.panels, self.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def panel_gemm_suits(weight_t: torch.Tensor) -> bool:
    """Whether ``weight_t`` should be served by the panel GEMM: CPU fp32 with a library built for AVX-512, or
    CPU bf16 with any build of the library."""
    if weight_t.device.type != "cpu" or weight_t.dtype not in (torch.float32, torch.bfloat16):
        return False
    lib = c_library()
    return lib is not None and (weight_t.dtype == torch.bfloat16 or bool(lib.gemm_uses_avx512()))


def panel_linear(x: torch.Tensor, weight: PanelWeight) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for 2-D ``x`` on CPU, in the panels' dtype (``x`` is converted to it)."""
    lib = c_library()
    assert lib is not None, "panel weights are only packed where the C library builds"
    dtype = weight.panels.dtype
    if x.dtype != dtype:
        x = x.to(dtype)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], weight.out_features, dtype=dtype)
    bias = weight.bias.data_ptr() if weight.bias is not None else None
    lib.panel_linear(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.shape[0], weight.in_features, weight.out_features,
        weight.panels.data_ptr(), bias, weight.kind, weight.threads,
    )  # fmt: skip
    return y
