"""How `loraplex up` splits the cores: training takes the smaller share, either side can be set, and OpenMP
is told to wait passively only where the shares overlap."""

from __future__ import annotations

import pytest

from core.cpu_share import CpuShares, available_cores, split_cores
from core.errors import ConfigError


@pytest.mark.parametrize(
    ("cores", "server", "training"),
    [(1, 1, 1), (2, 1, 1), (4, 3, 1), (8, 6, 2), (16, 12, 4), (64, 48, 16)],
)
def test_training_gets_one_core_up_to_four_then_a_quarter(cores: int, server: int, training: int) -> None:
    assert split_cores(cores) == CpuShares(cores, server, training)


def test_either_side_can_be_set_and_the_other_gets_the_rest() -> None:
    assert split_cores(16, server=10) == CpuShares(16, 10, 6)
    assert split_cores(16, training=8) == CpuShares(16, 8, 8)
    assert split_cores(16, server=16) == CpuShares(16, 16, 1)  # training still gets a thread: shared
    assert split_cores(2, server=4, training=4) == CpuShares(2, 4, 4)


def test_openmp_waits_passively_only_where_the_shares_overlap() -> None:
    assert split_cores(8).env(6) == {"OMP_NUM_THREADS": "6"}
    shared = split_cores(1)
    assert shared.oversubscribed
    assert shared.env(1) == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert "OpenMP waits passively" in shared.describe()


@pytest.mark.parametrize(("server", "training"), [(0, None), (None, 0), (-1, 2)])
def test_a_share_below_one_thread_is_refused_naming_it(server: int | None, training: int | None) -> None:
    with pytest.raises(ConfigError, match="threads must be at least 1"):
        split_cores(4, server, training)


def test_the_cores_are_those_this_process_may_run_on() -> None:
    assert available_cores() >= 1
