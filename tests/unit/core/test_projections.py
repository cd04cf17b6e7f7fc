"""One definition of the adapted projections: names, table order and fused groups agree everywhere."""

from __future__ import annotations

import pytest

from core.adapter_format import BaseShapes, module_name
from core.projections import (
    ATTENTION_PROJECTIONS,
    MLP_PROJECTIONS,
    NUM_PROJECTIONS,
    PROJ_INDEX,
    PROJECTION_GROUPS,
    PROJECTIONS,
    ProjectionGroup,
    check_groups,
)

# Every width distinct (q_size != hidden_size too), so only projections that truly share an input agree.
SHAPES = BaseShapes(num_layers=1, hidden_size=32, intermediate_size=48, q_size=40, kv_size=16)


def test_names_are_in_layer_order() -> None:
    # The order clients see in target_modules lists, and the column of each projection in the kernel tables.
    assert PROJECTIONS == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert NUM_PROJECTIONS == len(PROJECTIONS) == len(set(PROJECTIONS))
    assert all(PROJ_INDEX[name] == i for i, name in enumerate(PROJECTIONS))


def test_groups_cover_every_projection_once_in_table_order() -> None:
    indices = [i for group in PROJECTION_GROUPS for i in group.indices]
    assert indices == list(range(NUM_PROJECTIONS))
    assert [g.name for g in PROJECTION_GROUPS] == ["qkv", "o", "gate_up", "down"]


def test_each_group_shares_one_input() -> None:
    for group in PROJECTION_GROUPS:
        assert len({SHAPES.in_out(p)[0] for p in group.projections}) == 1, group.name


def test_parents_match_the_module_names() -> None:
    assert ATTENTION_PROJECTIONS + MLP_PROJECTIONS == PROJECTIONS
    for group in PROJECTION_GROUPS:
        for p in group.projections:
            assert module_name(3, p) == f"model.layers.3.{group.parent}.{p}"


@pytest.mark.parametrize(
    "groups",
    [
        tuple(reversed(PROJECTION_GROUPS)),  # groups out of table order
        PROJECTION_GROUPS[:-1],  # a projection in no group
        (*PROJECTION_GROUPS, ProjectionGroup("again", "mlp", ("down_proj",))),  # one in two groups
    ],
)
def test_groups_that_disagree_with_the_names_are_refused(groups) -> None:
    with pytest.raises(ValueError, match="table order"):
        check_groups(groups, PROJECTIONS)


def test_reordered_names_are_refused() -> None:
    with pytest.raises(ValueError, match="table order"):
        check_groups(PROJECTION_GROUPS, (*PROJECTIONS[1:], PROJECTIONS[0]))


def test_each_family_names_modules_that_tile_the_projections() -> None:
    from core.projections import FAMILY_MODULES, FUSED_MODULES, adapter_modules

    for family, modules in FAMILY_MODULES.items():
        assert tuple(p for m in modules.modules for p in m.projections) == PROJECTIONS, family
    assert adapter_modules("phi3") is FUSED_MODULES and FUSED_MODULES.names == (
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"
    )  # fmt: skip
    assert adapter_modules("llama").names == adapter_modules(None).names == PROJECTIONS
    phi3 = BaseShapes(num_layers=1, hidden_size=32, intermediate_size=48, q_size=40, kv_size=16, model_type="phi3")
    assert phi3.in_out("qkv_proj") == (32, 72) and phi3.in_out("gate_up_proj") == (32, 96)
    assert module_name(2, "gate_up_proj") == "model.layers.2.mlp.gate_up_proj"
    # What a trainer asks for becomes the family's modules; half a fused module cannot be adapted.
    assert FUSED_MODULES.targets(PROJECTIONS) == FUSED_MODULES.names
    assert FUSED_MODULES.targets(["v_proj", "k_proj", "q_proj", "down_proj"]) == ("qkv_proj", "down_proj")
    with pytest.raises(ValueError, match="q_proj, k_proj, v_proj in one matrix, qkv_proj"):
        FUSED_MODULES.targets(["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="no qkv_proj; choose from q_proj, k_proj"):
        adapter_modules("mistral").targets(["qkv_proj"])
