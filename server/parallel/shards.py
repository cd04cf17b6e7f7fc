"""Which slice of the model and of each adapter a tensor-parallel rank holds, as Megatron and S-LoRA shard them.

* q/k/v and gate/up are column-parallel: a rank computes its heads (and KV heads) and its MLP columns. Their
  LoRA keeps A whole and shards B by output rows, so a rank's delta is exactly its columns of the full delta.
* o and down are row-parallel: a rank reads its slice of the input and its partial outputs are summed by one
  all-reduce per projection. Their LoRA shards A by input columns and keeps B whole: ``(x_r A_r^T) B^T`` summed
  over ranks is the full delta, so it rides in the same all-reduce as the base output and costs no collective.
* The embedding and the LM head are split over the vocabulary (the last rank's slice may be shorter).

Every rank's slice has the same shape, so every rank's pool has the same pages and every adapter the same plan:
rank 0 decides where an adapter goes and the others write their slices at the same place.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from core.adapter_format import AdapterWeights, LoraTensors
from core.errors import ConfigError
from server.model.config import ModelConfig

# Projections whose input is split (their partial outputs are all-reduced); the others split their output.
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` tensor-parallel ranks; ``Shard()`` is the whole model on one rank."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} of {self.world} ranks does not exist")

    @property
    def is_whole(self) -> bool:
        return self.world == 1

    def part(self, size: int) -> slice:
        """This rank's equal share of ``size`` (which the world size divides)."""
        if size % self.world:
            raise ValueError(f"{size} does not split into {self.world} equal parts")
        step = size // self.world
        return slice(self.rank * step, (self.rank + 1) * step)

    def vocab_part(self, vocab_size: int) -> slice:
        """This rank's rows of the embedding and the LM head: ``ceil(vocab / world)`` each, the last one shorter."""
        step = -(-vocab_size // self.world)
        return slice(min(self.rank * step, vocab_size), min((self.rank + 1) * step, vocab_size))

    def vocab_width(self, vocab_size: int) -> int:
        """Columns of every rank's logits before they are gathered (the last rank's are padded to it)."""
        return -(-vocab_size // self.world)

    def config(self, config: ModelConfig) -> ModelConfig:
        """The model as one rank computes it: its heads, KV heads and MLP columns (hidden and vocab unchanged).

        Refuses sizes the world size does not divide, naming them: KV heads are not replicated across ranks."""
        if self.is_whole:
            return config
        sizes = {
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "intermediate_size": config.intermediate_size,
        }
        bad = [f"{name} ({size})" for name, size in sizes.items() if size % self.world]
        if bad:
            raise ConfigError(
                f"tensor_parallel_size {self.world} must divide {', '.join(bad)} of this model; "
                f"choose a size that divides {config.num_kv_heads} KV heads"
            )
        return replace(
            config,
            num_heads=config.num_heads // self.world,
            num_kv_heads=config.num_kv_heads // self.world,
            intermediate_size=config.intermediate_size // self.world,
        )

    def adapter(self, weights: AdapterWeights) -> AdapterWeights:
        """This rank's slice of an adapter checked against the whole model: B's output rows of column-parallel
        projections, A's input columns of row-parallel ones (contiguous copies, ready to pack)."""
        if self.is_whole:
            return weights
        modules = {}
        for (layer, proj), t in weights.modules.items():
            if proj in ROW_PARALLEL:
                a, b = t.a[:, self.part(t.a.shape[1])], t.b
            else:
                a, b = t.a, t.b[self.part(t.b.shape[0])]
            modules[(layer, proj)] = LoraTensors(a.contiguous(), b.contiguous(), t.scale)
        return AdapterWeights(modules)
