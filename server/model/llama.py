"""The Llama-family decoder (Llama, Mistral, Qwen2) over the paged arena, with per-segment LoRA deltas."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex_kernels import DOWN, GATE_UP, QKV, LayerLoraTables, LoraDelta, LoraTables, Segments, SliceGroup
from loraplex_kernels import O as O_PROJ
from server.model.attention import AttentionMetadata, paged_attention, write_kv
from server.model.config import ModelConfig
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
        return cls(
            arena=arena,
            layers=[tables.layer(n) for n in range(config.num_layers)],
            qkv=SliceGroup.contiguous(QKV, (config.q_size, config.kv_size, config.kv_size)),
            o=SliceGroup.contiguous(O_PROJ, (config.hidden_size,)),
            gate_up=SliceGroup.contiguous(GATE_UP, (config.intermediate_size, config.intermediate_size)),
            down=SliceGroup.contiguous(DOWN, (config.hidden_size,)),
        )

    def delta(self, tables: LayerLoraTables, group: SliceGroup, segs: Segments) -> LoraDelta:
        """One layer's LoRA for ``group`` in this step, for the projection that computes it."""
        return LoraDelta(self.arena, tables, group, segs)


class LlamaModel:
    """Forward pass over a flat batch of tokens from many sequences (no padding)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        lora: LoraBinding,
        max_positions: int,
    ) -> None:
        self.config = config
        self.weights = weights
        self.kv_caches = kv_caches
        self.lora = lora
        dtype, device = weights.embed.dtype, weights.embed.device
        self.rope = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype, device)
        self.scale = config.head_dim**-0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, segs: Segments
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` before the final norm; writes the tokens' K/V into their pages."""
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
        c, w, lora = self.config, self.weights.layers[n], self.lora
        tables = lora.layers[n]
        num_tokens = x.shape[0]

        h = F.rms_norm(x, (c.hidden_size,), w.input_norm, c.rms_norm_eps)
        qkv = w.qkv(h, lora.delta(tables, lora.qkv, segs) if use_lora else None)
        qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        self.rope.apply_(qk, cos, sin)
        q = qk[:, : c.num_heads]
        k = qk[:, c.num_heads :]
        v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
        k_cache, v_cache = self.kv_caches[n]
        write_kv(k_cache, v_cache, k, v, meta)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale).reshape(num_tokens, c.q_size)
        x.add_(w.o(attn, lora.delta(tables, lora.o, segs) if use_lora else None))

        h = F.rms_norm(x, (c.hidden_size,), w.post_norm, c.rms_norm_eps)
        gate_up = w.gate_up(h, lora.delta(tables, lora.gate_up, segs) if use_lora else None)
        act = F.silu(gate_up[:, : c.intermediate_size]).mul_(gate_up[:, c.intermediate_size :])
        x.add_(w.down(act, lora.delta(tables, lora.down, segs) if use_lora else None))
