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
