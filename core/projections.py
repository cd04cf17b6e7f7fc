"""The adapted projections of a Llama-family layer: their names, their table order, their fused groups.

The one definition the adapter format, the trainer's defaults, the pool and the forward pass share; with
:data:`FAMILY_MODULES`, the names each family's checkpoints and PEFT adapters give those projections.
A projection's index (its position in :data:`PROJECTIONS`) is its column in the kernels' LoRA tables;
the kernels know only :data:`NUM_PROJECTIONS` and receive a group's indices through ``SliceGroup``.
"""

from __future__ import annotations

from collections.abc import Iterable
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


@dataclass(frozen=True)
class AdapterModule:
    """A linear module of a decoder layer as PEFT names it, and the projections whose rows it holds, in order."""

    name: str  # q_proj, ..., or a fused module such as Phi-3's qkv_proj
    parent: str  # "self_attn" or "mlp"
    projections: tuple[str, ...]


@dataclass(frozen=True)
class AdapterModules:
    """The modules one family's adapters may target, in table order; every projection is in exactly one."""

    modules: tuple[AdapterModule, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modules)

    def get(self, name: str) -> AdapterModule | None:
        """The module called ``name``, or None when the family has no such module."""
        return next((m for m in self.modules if m.name == name), None)

    def targets(self, requested: Iterable[str]) -> tuple[str, ...]:
        """The modules to adapt for ``requested`` names (modules, or projections that fill whole modules), in
        table order: all seven projections are all four of Phi-3's modules. ValueError names what cannot be."""
        covered: set[str] = set()
        for name in requested:
            module = self.get(name)
            if module is None and name not in PROJ_INDEX:
                raise ValueError(f"target_modules: this model has no {name}; choose from {', '.join(self.names)}")
            covered |= set(module.projections if module else (name,))
        chosen = []
        for module in self.modules:
            part = covered & set(module.projections)
            if part and part != set(module.projections):
                raise ValueError(
                    f"target_modules: this model holds {', '.join(module.projections)} in one matrix, {module.name}; "
                    "adapt all of them or none"
                )
            if part:
                chosen.append(module.name)
        return tuple(chosen)


# Llama, Mistral, Qwen and Gemma name each projection; Phi-3 stores q/k/v and gate/up fused, one module each
# (exactly our fused groups), so its adapters share one A across the projections of a fused module.
SEPARATE_MODULES = AdapterModules(
    tuple(AdapterModule(p, g.parent, (p,)) for g in PROJECTION_GROUPS for p in g.projections)
)
FUSED_MODULES = AdapterModules(
    tuple(AdapterModule(f"{g.name}_proj", g.parent, g.projections) for g in PROJECTION_GROUPS)
)
FAMILY_MODULES: dict[str, AdapterModules] = {
    "llama": SEPARATE_MODULES,
    "mistral": SEPARATE_MODULES,
    "qwen2": SEPARATE_MODULES,
    "qwen3": SEPARATE_MODULES,
    "gemma": SEPARATE_MODULES,
    "gemma2": SEPARATE_MODULES,
    "gemma3": SEPARATE_MODULES,
    "gemma3_text": SEPARATE_MODULES,
    "phi3": FUSED_MODULES,
}


def adapter_modules(model_type: str | None) -> AdapterModules:
    """The modules adapters of a ``model_type`` name; a type not listed is read as Llama-shaped."""
    return FAMILY_MODULES.get(model_type or "", SEPARATE_MODULES)
