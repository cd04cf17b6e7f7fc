"""Step costs learned online and the prompt budget they give: a step with prompt chunks stays within its
stretch of a decode-only step, whatever the device's speed."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.step_costs import BACKLOG_STEPS, StepCosts


def device(fixed: float, per_decode: float, per_prompt_token: float, noise: float = 0.0, seed: int = 0):
    """A step's time on a device where a step costs ``fixed`` plus its tokens' costs, with relative noise."""
    rng = random.Random(seed)

    def step(decodes: int, prompt_tokens: int) -> float:
        exact = fixed + per_decode * decodes + per_prompt_token * prompt_tokens
        return exact * (1.0 + rng.uniform(-noise, noise))

    return step


def learn(costs: StepCosts, step, rounds: int = 200, seed: int = 1) -> None:
    """Mixed traffic: decode-only steps with 1-16 decodes, and some steps with prompt chunks beside them."""
    rng = random.Random(seed)
    for _ in range(rounds):
        decodes = rng.randint(1, 16)
        prompt = rng.choice([0, 0, 0, rng.randint(16, 256)])
        costs.observe(decodes, prompt, step(decodes, prompt))


def test_until_costs_are_known_the_static_cap_applies():
    costs = StepCosts()
    assert costs.prompt_budget(8, 248, 16) == 248
    costs.observe(0, 200, 0.05)  # before a step's fixed cost is known, a prompt's share of its time is not either
    assert costs.prompt_token_seconds() is None and costs.prompt_budget(8, 248, 16) == 248
    for _ in range(3):
        costs.observe(8, 0, 0.006)
    assert costs.decode_seconds(8) is None  # too few decode-only steps to trust


@pytest.mark.parametrize(
    "name, fixed, per_decode, per_prompt_token",
    [("cpu", 3e-3, 0.4e-3, 0.15e-3), ("gpu", 8e-3, 0.05e-3, 0.02e-3)],
)
def test_a_step_with_prompt_chunks_stays_within_its_stretch_of_a_decode_only_step(
    name, fixed, per_decode, per_prompt_token
):
    step = device(fixed, per_decode, per_prompt_token)
    costs = StepCosts(stretch=2.0)
    learn(costs, step)
    for decodes in (1, 4, 16):
        assert costs.decode_seconds(decodes) == pytest.approx(step(decodes, 0), rel=1e-6)
        budget = costs.prompt_budget(decodes, 100_000, 16)
        assert step(decodes, budget) <= 2.0 * step(decodes, 0) * (1 + 1e-9)
        assert step(decodes, budget + 1) > 2.0 * step(decodes, 0) * (1 - 1e-9)  # and no shorter than it has to be


def test_the_budget_grows_with_the_decodes_and_with_the_stretch():
    step = device(3e-3, 0.4e-3, 0.15e-3)
    tight, loose = StepCosts(stretch=1.5), StepCosts(stretch=3.0)
    learn(tight, step)
    learn(loose, step)
    budgets = [tight.prompt_budget(d, 100_000, 16) for d in (1, 8, 32)]
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1]
    assert loose.prompt_budget(8, 100_000, 16) > tight.prompt_budget(8, 100_000, 16)


def test_the_budget_follows_the_backlog_between_the_two_stretches():
    """A prompt or two waiting clear within the steady stretch; a backlog gets what clears it in BACKLOG_STEPS
    steps, up to the full stretch."""
    step = device(3e-3, 0.4e-3, 0.15e-3)
    costs = StepCosts(stretch=3.0, min_stretch=1.5)
    learn(costs, step)
    decodes, unbounded = 8, 100_000
    steady = costs.prompt_budget(decodes, unbounded, 16, backlog=0)
    assert step(decodes, steady) <= 1.5 * step(decodes, 0) * (1 + 1e-9) < step(decodes, steady + 1)
    assert costs.prompt_budget(decodes, unbounded, 16, backlog=steady * BACKLOG_STEPS) == steady
    between = costs.prompt_budget(decodes, unbounded, 16, backlog=2 * steady * BACKLOG_STEPS)
    assert between == 2 * steady
    flooded = costs.prompt_budget(decodes, unbounded, 16, backlog=unbounded)
    assert flooded == costs.prompt_budget(decodes, unbounded, 16)  # no backlog given: the full stretch
    assert step(decodes, flooded) <= 3.0 * step(decodes, 0) * (1 + 1e-9) < step(decodes, flooded + 1)


def test_the_token_caps_room_and_a_page_bound_the_budget():
    slow = StepCosts(stretch=1.1)
    learn(slow, device(1e-3, 0.1e-3, 5e-3))  # prompt tokens so dear that the stretch leaves less than a page
    assert slow.prompt_budget(4, 252, 16) == 16
    fast = StepCosts()
    learn(fast, device(8e-3, 0.05e-3, 1e-6))  # prompt tokens nearly free: the token cap decides
    assert fast.prompt_budget(4, 252, 16) == 252


def test_costs_follow_a_device_that_slows_down():
    costs = StepCosts(stretch=3.0, half_life_steps=32)
    learn(costs, device(3e-3, 0.4e-3, 0.15e-3))
    before = costs.prompt_budget(8, 100_000, 16)
    learn(costs, device(3e-3, 0.4e-3, 0.6e-3), rounds=600, seed=2)  # prompts now cost four times as much
    after = costs.prompt_budget(8, 100_000, 16)
    assert after == pytest.approx(before / 4, rel=0.05)


def test_one_batch_size_only_gives_a_flat_line_not_a_wild_slope():
    costs = StepCosts()
    for _ in range(50):
        costs.observe(8, 0, 0.006)
    assert costs.decode_seconds(1) == pytest.approx(0.006) and costs.decode_seconds(64) == pytest.approx(0.006)


@settings(max_examples=60, deadline=None)
@given(
    fixed=st.floats(1e-4, 0.05),
    per_decode=st.floats(0.0, 1e-3),
    per_prompt_token=st.floats(1e-6, 1e-3),
    noise=st.floats(0.0, 0.3),
    decodes=st.integers(1, 64),
    most=st.integers(16, 4096),
    backlog=st.one_of(st.none(), st.integers(0, 100_000)),
)
def test_the_budget_is_always_within_a_page_and_the_token_caps_room(
    fixed, per_decode, per_prompt_token, noise, decodes, most, backlog
):
    costs = StepCosts()
    learn(costs, device(fixed, per_decode, per_prompt_token, noise), rounds=60)
    assert 16 <= costs.prompt_budget(decodes, most, 16, backlog) <= most


def test_a_stretch_of_one_or_less_is_refused():
    with pytest.raises(ValueError, match="above 1"):
        StepCosts(stretch=1.0)
