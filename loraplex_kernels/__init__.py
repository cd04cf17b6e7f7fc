"""Multi-LoRA and paged-attention kernels behind one backend object, chosen once per engine.

:func:`select_backend` picks the implementation from the device, the dtype and ``LORAPLEX_KERNELS``
(read once, when it is called): ``auto`` (default: Triton on CUDA, torch elsewhere), ``torch`` or
``triton``. Forcing Triton on CPU needs ``TRITON_INTERPRET=1`` set before triton is first imported.
The implementation modules (``torch_ops``, ``triton_sgmv``, ``triton_attention``, ``reference``) keep
their plain functions for tests and benchmarks. This package imports nothing else of loraplex.
"""

from __future__ import annotations

from loraplex_kernels.backends import BACKENDS, KernelBackend, TorchBackend, TritonBackend, select_backend
from loraplex_kernels.layout import (
    NO_ADAPTER,
    ROW_ALIGN,
    KVGeometry,
    LayerLoraTables,
    LoraTables,
    SegmentRuns,
    Segments,
    SliceGroup,
    kv_cache_views,
)

__all__ = [
    "BACKENDS",
    "NO_ADAPTER",
    "ROW_ALIGN",
    "KVGeometry",
    "KernelBackend",
    "LayerLoraTables",
    "LoraTables",
    "SegmentRuns",
    "Segments",
    "SliceGroup",
    "TorchBackend",
    "TritonBackend",
    "kv_cache_views",
    "select_backend",
]
