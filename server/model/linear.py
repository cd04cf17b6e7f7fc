"""Dense projections in the fastest layout for their device, each adding its group's LoRA delta.

On CPU in fp32 the weight is packed once: into panels for our C GEMM (``loraplex_kernels.cpu_linear``) when
that library is built with AVX-512, which is within 1% of oneDNN or faster at every row count the engine runs
(``bench/linear_cpu.py``); otherwise for oneDNN, whose kernels beat a plain matmul by 15-25% at the small
batch sizes of decode steps (measured on the benchmark's shapes). In bf16 on CPU the panels hold bf16 (AMX tiles
where the CPU has them; 512 x 1408 on one thread: about 4x the fp32 panels at 1-8 rows, 6-7x from 32 rows up).
Elsewhere the weight is kept transposed (``[in, out]``) for ``x @ w``.

oneDNN builds and keeps a kernel for every distinct number of input rows, about 1 MiB each (measured:
1,024 row counts on one weight took 0.9 GiB, and evicting them from its cache does not return the memory).
A server's steps take every row count from 1 to the step budget, so unbounded this grows for as long as it
serves. Packed matmuls therefore only ever see a few row counts: inputs are padded up to a bucket and
inputs longer than the largest bucket are cut into chunks of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex_kernels import KernelBackend, LayerLoraTables, Segments, SliceGroup
from loraplex_kernels.cpu_linear import PanelWeight, panel_gemm_suits, panel_linear

# oneDNN picks its blocking from an expected batch size; decode batches are tens of tokens.
PACK_BATCH_HINT = 64
# Row buckets for packed matmuls: 8 to 64 in steps of 8 (decode batches, little padding), then 96 to 256 in
# steps of 32; longer inputs run in chunks of 256 rows. 14 kernels per weight shape, whatever the traffic.
SMALL_ROW_STEP, SMALL_ROWS = 8, 64
LARGE_ROW_STEP, MAX_PACKED_ROWS = 32, 256


@dataclass(frozen=True)
class LoraDelta:
    """One projection group's LoRA for one step: the engine's kernels and what they need besides ``x`` and ``y``."""

    kernels: KernelBackend
    arena: torch.Tensor
    tables: LayerLoraTables
    group: SliceGroup
    segs: Segments


class Linear:
    """``y = x @ W^T + b (+ LoRA delta)`` for 2-D ``x``; ``weight_t`` is ``W^T`` (``[in, out]``)."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.in_features, self.out_features = weight_t.shape
        self.bias = bias
        self._panels = PanelWeight.pack(weight_t, bias) if panel_gemm_suits(weight_t) else None
        self._packed = _pack_for_onednn(weight_t) if self._panels is None else None
        # A packed copy replaces the plain one: keeping both would double the model's memory.
        self.weight_t = weight_t if self._panels is None and self._packed is None else None

    def __call__(self, x: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:
        """The projection of ``x``, plus ``lora``'s per-segment delta (through its kernels) when given."""
        if self._panels is not None:
            y = panel_linear(x, self._panels)
        elif self._packed is not None:
            y = self._packed_matmul(x, self.bias)
        elif self.bias is None:
            y = x @ self.weight_t
        else:
            y = torch.addmm(self.bias, x, self.weight_t)
        if lora is not None:
            lora.kernels.add_lora(y, x, lora.arena, lora.tables, lora.group, lora.segs)
        return y

    def _packed_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= MAX_PACKED_ROWS:
            return self._packed_bucket(x, bias)
        out = x.new_empty(rows, self.out_features)
        for start in range(0, rows, MAX_PACKED_ROWS):
            out[start : start + MAX_PACKED_ROWS] = self._packed_bucket(x[start : start + MAX_PACKED_ROWS], bias)
        return out

    def _packed_bucket(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` (at most ``MAX_PACKED_ROWS`` rows) through oneDNN with its rows padded up to a bucket."""
        rows = x.shape[0]
        bucket = row_bucket(rows)
        if bucket != rows:
            padded = x.new_zeros(bucket, self.in_features)
            padded[:rows] = x
            x = padded
        y = torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [None], "")
        return y if bucket == rows else y[:rows]

    def dense_weight_t(self) -> torch.Tensor:
        """``W^T`` as a plain tensor (for tests and merging), whatever the storage layout."""
        if self._panels is not None:
            return self._panels.dense_weight_t()
        if self.weight_t is not None:
            return self.weight_t
        return self._packed_matmul(torch.eye(self.in_features, dtype=torch.float32), None)

    def num_bytes(self) -> int:
        if self._panels is not None:
            return self._panels.num_bytes()
        tensors = [t for t in (self.weight_t, self.bias) if t is not None]
        packed = self.in_features * self.out_features * 4 if self._packed is not None else 0
        return packed + sum(t.numel() * t.element_size() for t in tensors)


def row_bucket(rows: int) -> int:
    """The row count a packed matmul of ``rows`` (1..``MAX_PACKED_ROWS``) input rows runs at."""
    step = SMALL_ROW_STEP if rows <= SMALL_ROWS else LARGE_ROW_STEP
    return -(-rows // step) * step


def _pack_for_onednn(weight_t: torch.Tensor) -> torch.Tensor | None:
    if weight_t.device.type != "cpu" or weight_t.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):  # a torch build without these ops: plain matmul
        return None
