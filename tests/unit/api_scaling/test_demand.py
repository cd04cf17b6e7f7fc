"""The replica count a base's load wants, and the token rate it reports."""

from __future__ import annotations

import pytest

from api.scaling.demand import TokenRate, replicas_wanted


@pytest.mark.parametrize(
    ("in_flight", "held", "idle", "ttl", "wanted"),
    [
        (0, 0, 0.0, None, 1),  # no TTL: never zero
        (0, 0, 10_000.0, None, 1),
        (0, 0, 59.0, 60.0, 1),  # not idle long enough yet
        (0, 0, 60.0, 60.0, 0),
        (0, 1, 600.0, 60.0, 1),  # a held request wants a replica however long the base slept
        (1, 0, 600.0, 60.0, 1),  # so does one in flight (a long stream)
        (32, 0, 0.0, 60.0, 1),
        (33, 0, 0.0, 60.0, 2),
        (40, 30, 0.0, 60.0, 3),
        (10_000, 0, 0.0, 60.0, 8),  # capped
    ],
)
def test_replicas_wanted(in_flight: int, held: int, idle: float, ttl: float | None, wanted: int) -> None:
    assert replicas_wanted(in_flight, held, idle, idle_ttl=ttl, target_requests=32, most=8) == wanted


def test_the_token_rate_covers_the_last_window_only() -> None:
    now = [100.0]
    rate = TokenRate(window=10.0, clock=lambda: now[0])
    rate.add(50)
    now[0] = 105.0
    rate.add(30)
    rate.add(0)
    assert rate.per_second() == 8.0
    now[0] = 110.5  # the first 50 fell out of the window
    assert rate.per_second() == 3.0
    now[0] = 200.0
    assert rate.per_second() == 0.0
