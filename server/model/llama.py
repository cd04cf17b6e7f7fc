"""The Llama-family decoder over the paged arena, with per-segment LoRA deltas.

One forward for every family (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text...); a family is the switches
of its :class:`ModelConfig`, checked once per layer (or once per model, when they pick a function).

Under tensor parallelism (``tp``) the config is one rank's (:meth:`server.parallel.shards.Shard.config`): the layer
computes its heads and MLP columns, and the o and down outputs (LoRA deltas included) are summed over the ranks by
one all-reduce each. The embedding and the LM head hold a slice of the vocabulary each.
"""

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
from server.parallel.group import TensorParallel


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
        tp: TensorParallel | None = None,
    ) -> None:
        self.config = config
        self.tp = tp
        self.weights = weights
        self.kv_caches = kv_caches
        self.lora = lora
        self.kernels = kernels  # chosen once by the engine builder; the runner prepares it every step
        dtype, device = weights.embed.dtype, weights.embed.device
        # One table per distinct rope (Gemma 3's local and global layers differ), and each layer's index into them.
        ropes = list(dict.fromkeys(config.layer_rope(n) for n in range(config.num_layers)))
        self.ropes = [RotaryEmbedding(rope, config.head_dim, max_positions, dtype, device) for rope in ropes]
        self.layer_rope = [ropes.index(config.layer_rope(n)) for n in range(config.num_layers)]
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the model's dtype, as transformers does.
        self.embed_scale = None if config.embed_scale is None else torch.tensor(config.embed_scale, dtype=dtype).item()
        self.norm = _plus_one_rms_norm if config.norm_plus_one else _rms_norm
        self.act = _gelu_tanh if config.hidden_act == "gelu_pytorch_tanh" else F.silu

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, segs: Segments
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` before the final norm; writes the tokens' K/V into their pages.

        ``segs`` must have been prepared on :attr:`kernels` for this step (``ModelRunner.prepare`` does it)."""
        x = F.embedding(input_ids, self.weights.embed) if self.tp is None else self._parallel_embedding(input_ids)
        if self.embed_scale is not None:
            x.mul_(self.embed_scale)
        rotary = [(rope, *rope.tables(positions)) for rope in self.ropes]
        use_lora = segs.max_rank > 0
        for n in range(self.config.num_layers):
            self._layer(n, x, rotary[self.layer_rope[n]], meta, segs, use_lora)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of the given rows."""
        h = self.norm(hidden, self.weights.norm, self.config.rms_norm_eps)
        logits = self.weights.lm_head(h)
        if self.tp is not None:  # each rank holds a slice of the vocabulary: put the slices side by side
            width = self.tp.shard.vocab_width(self.config.vocab_size)
            logits = self.tp.gather_columns(F.pad(logits, (0, width - logits.shape[1])))[:, : self.config.vocab_size]
        if self.config.final_softcap is not None:  # Gemma 2, in the model's dtype as transformers does
            cap = self.config.final_softcap
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits.float()

    def _layer(
        self,
        n: int,
        x: torch.Tensor,
        rotary: tuple[RotaryEmbedding, torch.Tensor, torch.Tensor],
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

        h = self.norm(x, w.input_norm, c.rms_norm_eps)
        qkv = w.qkv(h, delta(lora.qkv))
        qk = qkv[:, : c.q_size + c.kv_size].view(num_tokens, c.num_heads + c.num_kv_heads, c.head_dim)
        if w.qk_norm is not None:  # Qwen3, Gemma 3: normalise each q and k head, then rotate
            qk = self.norm(qk, w.qk_norm, c.rms_norm_eps)
        rope, cos, sin = rotary
        rope.apply_(qk, cos, sin)
        q = qk[:, : c.num_heads]
        k = qk[:, c.num_heads :]
        v = qkv[:, c.q_size + c.kv_size :].view(num_tokens, c.num_kv_heads, c.head_dim)
        k_cache, v_cache = self.kv_caches[n]
        write_kv(k_cache, v_cache, k, v, meta)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, kernels, c.layer_windows[n], c.attn_softcap)
        out = w.o(attn.reshape(num_tokens, c.q_size), delta(lora.o))
        if self.tp is not None:  # row-parallel: partial sums of the base output and the LoRA delta together
            self.tp.all_reduce_(out)
        x.add_(out if w.attn_out_norm is None else self.norm(out, w.attn_out_norm, c.rms_norm_eps))

        h = self.norm(x, w.post_norm, c.rms_norm_eps)
        gate_up = w.gate_up(h, delta(lora.gate_up))
        act = self.act(gate_up[:, : c.intermediate_size]).mul_(gate_up[:, c.intermediate_size :])
        out = w.down(act, delta(lora.down))
        if self.tp is not None:
            self.tp.all_reduce_(out)
        x.add_(out if w.mlp_out_norm is None else self.norm(out, w.mlp_out_norm, c.rms_norm_eps))

    def _parallel_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings from vocabulary slices: each rank looks up the tokens in its slice (zeros elsewhere), and
        the sum over ranks holds every token's row exactly once."""
        rows = self.tp.shard.vocab_part(self.config.vocab_size)
        local = input_ids - rows.start
        mine = (local >= 0) & (local < rows.stop - rows.start)
        x = F.embedding(local.clamp(0, rows.stop - rows.start - 1), self.weights.embed)
        return self.tp.all_reduce_(x.mul_(mine.unsqueeze(1).to(x.dtype)))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; ``weight`` broadcasts (one per head for q/k norms)."""
    if weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x, weight.shape[-1:], eps=eps).mul_(weight)


def _plus_one_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: in fp32, scaled by ``weight`` (which holds 1 + w in fp32), then cast back to ``x``'s dtype."""
    return F.rms_norm(x.float(), weight.shape[-1:], eps=eps).mul_(weight).to(x.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``gelu_pytorch_tanh`` (GeGLU's gate), as transformers' ``ACT2FN`` computes it."""
    return F.gelu(x, approximate="tanh")
