"""The serving benchmark's request sequence: Zipf popularity, length ranges, the same sequence for every system."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from bench.serve_workload import LengthRange, workload, zipf_weights


def test_zipf_weights_follow_one_over_rank_to_the_exponent() -> None:
    weights = zipf_weights(4, 1.0)
    assert sum(weights) == pytest.approx(1.0)
    assert [w / weights[0] for w in weights] == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4])
    assert zipf_weights(3, 2.0)[2] / zipf_weights(3, 2.0)[0] == pytest.approx(1 / 9)


def test_exponent_zero_is_uniform() -> None:
    assert zipf_weights(5, 0.0) == pytest.approx([0.2] * 5)


@pytest.mark.parametrize(("count", "exponent"), [(0, 1.0), (3, -0.5)])
def test_bad_zipf_arguments_are_refused(count: int, exponent: float) -> None:
    with pytest.raises(ValueError):
        zipf_weights(count, exponent)


def test_length_ranges_parse_and_validate() -> None:
    assert LengthRange.parse("16:128") == LengthRange(16, 128)
    assert LengthRange.parse("32") == LengthRange(32, 32)
    for bad in ("0:4", "9:3"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


def sample(n: int, seed: int = 0, adapters: int = 8, exponent: float = 1.0) -> list:
    return list(itertools.islice(workload(adapters, exponent, LengthRange(4, 9), LengthRange(2, 5), seed), n))


def test_the_same_seed_gives_the_same_requests() -> None:
    assert sample(50) == sample(50)
    assert sample(50) != sample(50, seed=1)


def test_requests_respect_the_ranges_and_are_numbered() -> None:
    items = sample(200)
    assert [item.index for item in items] == list(range(200))
    assert all(4 <= len(item.prompt) <= 9 and 2 <= item.max_tokens <= 5 for item in items)
    assert all(4 <= token < 260 for item in items for token in item.prompt)


def test_popular_adapters_get_more_requests() -> None:
    counts = Counter(item.adapter for item in sample(4000))
    assert set(counts) == set(range(8))
    # rank 1 gets ~37% of requests at s=1 over 8 adapters, rank 8 ~5%
    assert counts[0] > 2 * counts[3] > 0
    assert counts[0] / 4000 == pytest.approx(zipf_weights(8, 1.0)[0], abs=0.03)
