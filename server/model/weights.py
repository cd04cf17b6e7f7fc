"""Load a Llama-family checkpoint from local safetensors (single file or sharded) into fused weights.

Projections become :class:`~server.model.linear.Linear` (transposed, or pre-packed on CPU); q/k/v and
gate/up are fused so each is one matmul. Checkpoints that store them fused already (Phi-3's qkv_proj and
gate_up_proj, per ``core.projections.FAMILY_MODULES``) are taken as they are. A tensor-parallel rank reads only
its slices from the files (safetensors slices), never a whole copy of a sharded tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import ConfigError
from core.projections import DOWN, GATE_UP, O_PROJ, QKV, ProjectionGroup, adapter_modules
from server.model.config import ModelConfig
from server.model.linear import Linear
from server.parallel.shards import ROW_PARALLEL, Shard

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some older checkpoints carry; recomputed by us.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
WHOLE = Shard()


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> q + 2 kv (with the q/k/v biases when the model has them)
    o: Linear  # q -> hidden
    post_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim]: q_norm per q head, k_norm per kv head
    # Gemma 2/3 (``sandwich_norms``): their post_attention_layernorm normalises the attention output before the
    # residual add (``post_norm`` then holds pre_feedforward_layernorm), post_feedforward_layernorm the MLP's.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Linear  # hidden -> vocab

    def num_bytes(self) -> int:
        tensors = [self.embed, self.norm] + [t for layer in self.layers for t in (layer.input_norm, layer.post_norm)]
        tensors += [
            t
            for layer in self.layers
            for t in (layer.qk_norm, layer.attn_out_norm, layer.mlp_out_norm)
            if t is not None
        ]
        linears = [self.lm_head] + [
            lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(lin.num_bytes() for lin in linears)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's shard files: from ``model.safetensors.index.json`` when present."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors weights in {model_dir}; pickle checkpoints are not loaded")
    return files


class Checkpoint:
    """The checkpoint's tensors by name, read lazily: a tensor-parallel rank reads only its slices of each."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        self.model_dir = model_dir
        self._files = {}
        for path in safetensors_files(model_dir):
            handle = safe_open(str(path), framework="pt")
            self._files.update(dict.fromkeys(handle.keys(), handle))

    def names(self) -> list[str]:
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[name].get_slice(name).get_shape())

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """The tensor, or only ``rows`` (dim 0) and ``cols`` (dim 1) of it, as stored."""
        if rows is None and cols is None:
            return self._files[name].get_tensor(name)
        view = self._files[name].get_slice(name)
        return view[rows or slice(None)] if cols is None else view[rows or slice(None), cols]


def load_weights(
    model_dir: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, shard: Shard = WHOLE
) -> ModelWeights:
    """Read, check, fuse and place the weights of ``model_dir`` (``config`` is the whole model's), or with a
    ``shard`` only that tensor-parallel rank's slices (:mod:`server.parallel.shards`)."""
    checkpoint = Checkpoint(model_dir)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...], rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if name not in checkpoint:
            raise ConfigError(f"checkpoint in {model_dir} lacks {name}")
        if checkpoint.shape(name) != shape:
            raise ConfigError(f"{name} has shape {list(checkpoint.shape(name))}, config.json implies {list(shape)}")
        used.add(name)
        return checkpoint.read(name, rows, cols)

    def linear_t(*parts: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts, dim=0).t().to(device=device, dtype=dtype).contiguous()

    def vector(*parts: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts).to(device=device, dtype=dtype).contiguous()

    def norm_weight(name: str, size: int) -> torch.Tensor:
        """An RMSNorm's weight; Gemma's scale by 1 + w, kept as that sum in fp32 (transformers adds it in fp32)."""
        weight = take(name, (size,))
        return (weight.float() + 1.0).to(device).contiguous() if config.norm_plus_one else vector(weight)

    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    shapes, modules = config.base_shapes(), adapter_modules(config.model_type)
    rank = shard.config(config)  # the heads and MLP columns this rank computes

    def group_weight(prefix: str, group: ProjectionGroup) -> torch.Tensor:
        """``group``'s fused weight, transposed, from the checkpoint's modules that hold its projections: this
        rank's output rows of each column-parallel projection, its input columns of a row-parallel one."""
        parts = []
        for m in modules.modules:
            if m.projections[0] not in group.projections:
                continue
            name = f"{prefix}{m.parent}.{m.name}.weight"
            shape = shapes.in_out(m.name)[::-1]
            if shard.is_whole:
                parts.append(take(name, shape))
                continue
            at = 0  # a fused module stores its projections' rows one after another
            for proj in m.projections:
                size_in, size_out = shapes.in_out(proj)
                if proj in ROW_PARALLEL:
                    parts.append(take(name, shape, cols=shard.part(size_in)))
                else:
                    own = shard.part(size_out)
                    parts.append(take(name, shape, rows=slice(at + own.start, at + own.stop)))
                at += size_out
        return linear_t(*parts)

    def bias(name: str, size: int, parallel: bool) -> torch.Tensor | None:
        """A column-parallel bias is split with its rows; a row-parallel one is added once, by rank 0."""
        if parallel:
            return vector(take(name, (size,), rows=None if shard.is_whole else shard.part(size)))
        whole = take(name, (size,))
        return vector(whole) if shard.rank == 0 else None

    layers = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        qkv_bias = None
        if config.qkv_bias:
            sizes = (("q", q), ("k", kv), ("v", kv))
            qkv_bias = torch.cat([bias(p + f"self_attn.{x}_proj.bias", size, parallel=True) for x, size in sizes])
        qk_norm = None
        if config.qk_norm:
            d = (config.head_dim,)
            q_norm, k_norm = take(p + "self_attn.q_norm.weight", d), take(p + "self_attn.k_norm.weight", d)
            heads = torch.cat([q_norm.expand(rank.num_heads, -1), k_norm.expand(rank.num_kv_heads, -1)])
            qk_norm = (heads.float() + 1.0 if config.norm_plus_one else heads.to(dtype)).to(device).contiguous()
        layers.append(
            LayerWeights(
                input_norm=norm_weight(p + "input_layernorm.weight", h),
                qkv=Linear(group_weight(p, QKV), qkv_bias),
                o=Linear(
                    group_weight(p, O_PROJ),
                    bias(p + "self_attn.o_proj.bias", h, parallel=False) if config.o_bias else None,
                ),
                post_norm=norm_weight(
                    p + ("pre_feedforward" if config.sandwich_norms else "post_attention") + "_layernorm.weight", h
                ),
                gate_up=Linear(group_weight(p, GATE_UP)),
                down=Linear(group_weight(p, DOWN)),
                qk_norm=qk_norm,
                attn_out_norm=norm_weight(p + "post_attention_layernorm.weight", h) if config.sandwich_norms else None,
                mlp_out_norm=norm_weight(p + "post_feedforward_layernorm.weight", h) if config.sandwich_norms else None,
            )
        )
    vocab = shard.vocab_part(config.vocab_size)
    embed_shape = (config.vocab_size, h)
    embed = take("model.embed_tokens.weight", embed_shape, rows=None if shard.is_whole else vocab)
    embed = embed.to(device=device, dtype=dtype).contiguous()
    if config.tie_word_embeddings or "lm_head.weight" not in checkpoint:
        if not config.tie_word_embeddings:
            raise ConfigError(f"checkpoint in {model_dir} lacks lm_head.weight and does not tie embeddings")
        lm_head = Linear(embed.t())
        used.add("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    else:
        lm_head = Linear(linear_t(take("lm_head.weight", embed_shape, rows=None if shard.is_whole else vocab)))
    norm = norm_weight("model.norm.weight", h)
    unknown = sorted(k for k in checkpoint.names() if k not in used and not k.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise ConfigError(f"checkpoint has tensors this forward pass would ignore, e.g. {unknown[0]}")
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
