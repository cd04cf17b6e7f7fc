"""Dense projections in the fastest layout for their device.

On CPU in fp32 the weight is pre-packed once for oneDNN, whose kernels beat a plain matmul by
15-25% at the small batch sizes of decode steps (measured on the benchmark's shapes); elsewhere it
is kept transposed (``[in, out]``) for ``x @ w``.
"""

from __future__ import annotations

import torch

# oneDNN picks its blocking from an expected batch size; decode batches are tens of tokens.
PACK_BATCH_HINT = 64


class Linear:
    """``y = x @ W^T + b`` for 2-D ``x``; ``weight_t`` is ``W^T`` (``[in, out]``)."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.in_features, self.out_features = weight_t.shape
        self.bias = bias
        self._packed = _pack_for_onednn(weight_t)
        # The packed copy replaces the plain one: keeping both would double the model's memory.
        self.weight_t = weight_t if self._packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [None], "")
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)

    def dense_weight_t(self) -> torch.Tensor:
        """``W^T`` as a plain tensor (for tests and merging), whatever the storage layout."""
        if self.weight_t is not None:
            return self.weight_t
        eye = torch.eye(self.in_features, dtype=torch.float32)
        return torch.ops.mkldnn._linear_pointwise(eye, self._packed, None, "none", [None], "")

    def num_bytes(self) -> int:
        tensors = [t for t in (self.weight_t, self.bias) if t is not None]
        packed = self.in_features * self.out_features * 4 if self._packed is not None else 0
        return packed + sum(t.numel() * t.element_size() for t in tensors)


def _pack_for_onednn(weight_t: torch.Tensor) -> torch.Tensor | None:
    if weight_t.device.type != "cpu" or weight_t.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), PACK_BATCH_HINT)
    except (AttributeError, RuntimeError):  # a torch build without these ops: plain matmul
        return None
