"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged arena, with per-segment LoRA deltas."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.projections import DOWN, GATE_UP, O_PROJ, QKV, ProjectionGroup
from loraplex_kernels import KernelBackend, LayerLoraTables, LoraTables, Segments, SliceGroup
from server.model.attention import AttentionMetadata, paged_attention, write_kv
from server.model.config import ModelConfig
from server.model.linear import LoraDelta
from server.model.rope import RotaryEmbedding
from server.model.weights import ModelWeights


@dataclass
class LoraBinding:
    """The arena and per-layer table views every adapted projection reads, plus the fused slice groups."""

    arena: torch.Tensor
    layers: list[LayerLoraTables]
    qkv: SliceGroup
    o: SliceGroup
    gate_up: SliceGroup
    down: SliceGroup

    @classmethod
    def create(cls, arena: torch.Tensor, tables: LoraTables, config: ModelConfig) -> LoraBinding:
        shapes = config.base_shapes()

        def fused(group: ProjectionGroup) -> SliceGroup:
            return SliceGroup.contiguous(group.indices, tuple(shapes.in_out(p)[1] for p in group.projections))

        return cls(
            arena=arena,
            layers=[tables.layer(n) for n in range(config.num_layers)],
            qkv=fused(QKV),
            o=fused(O_PROJ),
            gate_up=fused(GATE_UP),
            down=fused(DOWN),
        )


class LlamaModel:
    """Forward pass over a flat batch of tokens from many sequences (no padding)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoraBinding,
        max_positions: int,
        kernels: KernelBackend,
    ) -> None:
        self.config = config
        self.weights = weights
        self.kv_caches = kv_caches
        self.lora = lora
        self.kernels = kernels  # chosen once by the engine builder; the runner prepares it every step
        dtype, device = weights.embed.dtype, weights.embed.device
        self.rope = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype, device)
        self.scale = config.head_dim**-0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, segs: Segments
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` before the final norm; writes the tokens' K/V into their pages.

        ``segs`` must have been prepared on :attr:`kernels` for this step (``ModelRunner.prepare`` does it)."""
        x = F.embedding(input_ids, self.weights.embed)
        cos, sin = self.rope.tables(positions)
        use_lora = segs.max_rank > 0
        for n in range(self.config.num_layers):
            self._layer(n, x, cos, sin, meta, segs, use_lora)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of the given rows."""
        h = F.rms_norm(hidden, (self.config.hidden_size,), self.weights.norm, self.config.rms_norm_eps)
        return self.weights.lm_head(h).float()

    def _layer(
        self,
        n: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        segs: Segments,
        use_lora: bool,
    ) -> None:
        """One decoder layer, updating the residual stream ``x`` in place."""
        c, w, lora, kernels = self.config, self.weights.layers[n], self.lora, self.kernels
        tables = lora.layers[n]
        num_tokens = x.shape[0]

        def delta(group: SliceGroup) -> LoraDelta | None:
            """This layer's LoRA for ``group`` in this step, for the projection that computes it."""
            return LoraDelta(kernels, lora.arena, tables, group, segs) if use_lora else None

        h = F.rms_norm(x, (c.hidden_size,), w.input_norm, c.rms_norm_eps)
        qkv = w.qkv(h, delta(lora.qkv))
        qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        if w.qk_norm is not None:  # Qwen3: normalise each q and k head, then rotate
            qk = F.rms_norm(qk, (c.head_dim,), eps=c.rms_norm_eps).mul_(w.qk_norm)
        self.rope.apply_(qk, cos, sin)
        q = qk[:, : c.num_heads]
        k = qk[:, c.num_heads :]
        v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
        k_cache, v_cache = self.kv_caches[n]
        write_kv(k_cache, v_cache, k, v, meta)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, kernels, c.layer_windows[n])
        attn = attn.reshape(num_tokens, c.q_size)
        x.add_(w.o(attn, delta(lora.o)))

        h = F.rms_norm(x, (c.hidden_size,), w.post_norm, c.rms_norm_eps)
        gate_up = w.gate_up(h, delta(lora.gate_up))
        act = F.silu(gate_up[:, : c.intermediate_size]).mul_(gate_up[:, c.intermediate_size :])
        x.add_(w.down(act, delta(lora.down)))
