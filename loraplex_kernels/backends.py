"""The kernels one engine runs, chosen once when it is built: torch (with the C loops on CPU) or Triton.

A backend serves tensors of the device and dtype it was built for. It is stateful per step, like vLLM's
punica wrapper: :meth:`KernelBackend.prepare` derives from the step's segments what every layer reuses
(the C loop's chunk plan), and the LoRA calls of that step then take the same segments.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

from loraplex_kernels import reference, torch_ops
from loraplex_kernels.configs import interpreting
from loraplex_kernels.layout import LayerLoraTables, Segments, SliceGroup

BACKENDS = ("auto", "torch", "triton")
KERNELS_ENV = "LORAPLEX_KERNELS"


class KernelBackend(ABC):
    """LoRA and paged-attention kernels for one device and dtype."""

    name: str
    # Whether paged_attention_prefill is the fast path for steps holding prompt chunks (one launch for every
    # row); where False the engine keeps attending per prompt chunk with SDPA.
    varlen_prefill: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._segs: Segments | None = None

    def prepare(self, segs: Segments) -> None:
        """Derive, once per step, what every layer's LoRA call reuses; call it before the step's LoRA calls."""
        self._segs = segs

    def _check_prepared(self, segs: Segments) -> None:
        if segs is not self._segs:
            raise ValueError("these segments were not prepared: call prepare(segs) once per step before add_lora")

    @abstractmethod
    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        arena: torch.Tensor,
        tables: LayerLoraTables,
        group: SliceGroup,
        segs: Segments,
    ) -> None:
        """``y += scale * B(A x)`` for every slice of ``group`` over the prepared segments, in place."""

    @abstractmethod
    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Decode attention of one query token per sequence over its paged KV cache: every cached token, or
        with a sliding ``window`` the last ``window`` of them (positions ``>= context_lens[b] - window``);
        ``softcap`` caps each scaled score ``s`` as ``softcap * tanh(s / softcap)`` (Gemma 2)."""

    def paged_attention_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        max_query_len: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of a whole step's rows ``[T, heads, d]`` (prompt chunks and decodes) over the paged
        cache, which already holds the step's keys: sequence ``s`` owns rows ``query_starts[s] ..
        + query_lens[s]`` at positions from ``context_lens[s]`` on (``loraplex_kernels.triton_prefill``).

        Backends without a varlen kernel (``varlen_prefill`` False, which the engine then never calls) answer
        with the plain per-sequence loop of :mod:`loraplex_kernels.reference`."""
        return reference.paged_attention_prefill(
            q, k_cache, v_cache, query_starts, query_lens, context_lens, block_tables, max_query_len, scale, window,
            softcap,
        )  # fmt: skip


class TorchBackend(KernelBackend):
    """Vectorised torch ops; in fp32 or bf16 on CPU the C loops, when they build (decided here, not per call)."""

    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device)
        self.loops = torch_ops.c_loops() if device.type == "cpu" and dtype in torch_ops.C_DTYPES else None
        self._plan: torch_ops.CStepPlan | None = None
        self._workspace: torch.Tensor | None = None  # the C loop's scratch, kept across steps

    def prepare(self, segs: Segments) -> None:
        super().prepare(segs)
        self._plan = torch_ops.c_step_plan(segs, self.loops, self._workspace)
        if self._plan is not None:
            self._workspace = self._plan.workspace

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        arena: torch.Tensor,
        tables: LayerLoraTables,
        group: SliceGroup,
        segs: Segments,
    ) -> None:
        self._check_prepared(segs)
        torch_ops.add_lora_planned(self._plan, y, x, arena, tables, group, segs)

    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return torch_ops.paged_attention_decode_with(
            self.loops, q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap
        )


class TritonBackend(KernelBackend):
    """The Triton kernels: on CUDA, or on CPU under the interpreter (``TRITON_INTERPRET=1``)."""

    name = "triton"
    varlen_prefill = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.interpret = interpreting()
        if device.type != "cuda" and not self.interpret:
            raise ValueError(
                f"Triton kernels need CUDA (the engine runs on {device}); set TRITON_INTERPRET=1 before triton is "
                f"imported to run them on CPU, or {KERNELS_ENV}=torch"
            )
        # Imported here: triton reads TRITON_INTERPRET when it is first imported.
        from loraplex_kernels import triton_attention, triton_prefill, triton_sgmv

        self._sgmv, self._attention, self._prefill = triton_sgmv, triton_attention, triton_prefill

    def add_lora(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        arena: torch.Tensor,
        tables: LayerLoraTables,
        group: SliceGroup,
        segs: Segments,
    ) -> None:
        self._check_prepared(segs)
        self._sgmv.add_lora(y, x, arena, tables, group, segs, interpret=self.interpret)

    def paged_attention_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return self._attention.paged_attention_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap, interpret=self.interpret
        )

    def paged_attention_prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
        max_query_len: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return self._prefill.paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            query_starts,
            query_lens,
            context_lens,
            block_tables,
            max_query_len,
            scale,
            window,
            softcap,
            interpret=self.interpret,
        )


def select_backend(device: torch.device, dtype: torch.dtype, choice: str | None = None) -> KernelBackend:
    """The backend for ``device`` and ``dtype``: ``auto`` (Triton on CUDA, torch elsewhere), ``torch`` or
    ``triton``. ``choice`` None reads ``LORAPLEX_KERNELS`` now, once; an unknown value raises ValueError."""
    raw = os.environ.get(KERNELS_ENV, "auto") if choice is None else choice
    name = raw.strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(BACKENDS)}, got {raw!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    return TritonBackend(device) if name == "triton" else TorchBackend(device, dtype)
