"""The adapted projections of a Llama-family layer: their names, their table order, their fused groups.

The one definition the adapter format, the trainer's defaults, the pool and the forward pass share.
A projection's index (its position in :data:`PROJECTIONS`) is its column in the kernels' LoRA tables;
the kernels know only :data:`NUM_PROJECTIONS` and receive a group's indices through ``SliceGroup``.
"""

from __future__ import annotations

from dataclasses import dataclass

PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_PROJECTIONS = len(PROJECTIONS)
PROJ_INDEX: dict[str, int] = {name: i for i, name in enumerate(PROJECTIONS)}


@dataclass(frozen=True)
class ProjectionGroup:
    """Projections that read the same input and are computed by one fused launch."""

    name: str
    parent: str  # the module they sit under in a decoder layer: "self_attn" or "mlp"
    projections: tuple[str, ...]

    @property
    def indices(self) -> tuple[int, ...]:
        """Table indices of the members, in order."""
        return tuple(PROJ_INDEX[p] for p in self.projections)


QKV = ProjectionGroup("qkv", "self_attn", ("q_proj", "k_proj", "v_proj"))
O_PROJ = ProjectionGroup("o", "self_attn", ("o_proj",))
GATE_UP = ProjectionGroup("gate_up", "mlp", ("gate_proj", "up_proj"))
DOWN = ProjectionGroup("down", "mlp", ("down_proj",))
PROJECTION_GROUPS: tuple[ProjectionGroup, ...] = (QKV, O_PROJ, GATE_UP, DOWN)


def check_groups(groups: tuple[ProjectionGroup, ...], names: tuple[str, ...]) -> None:
    """Raise ValueError unless ``groups`` list every name exactly once, in table order."""
    listed = tuple(p for g in groups for p in g.projections)
    if listed != names:
        raise ValueError(f"projection groups list {listed}; the table order is {names}")


# Checked at import: the pool packs a group's rows together and the kernels index the tables by it.
check_groups(PROJECTION_GROUPS, PROJECTIONS)


def _under(parent: str) -> tuple[str, ...]:
    return tuple(p for g in PROJECTION_GROUPS if g.parent == parent for p in g.projections)


ATTENTION_PROJECTIONS = _under("self_attn")
MLP_PROJECTIONS = _under("mlp")
