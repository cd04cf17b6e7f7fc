"""Sampler: greedy, seeded reproducibility independent of the batch, top-k/top-p, logprobs."""

from __future__ import annotations

import pytest
import torch

from core.errors import InvalidRequest
from server.engine.sampler import Sampler, SamplingRow
from server.engine.sampling_params import SamplingParams


def row(index: int = 0, completion: int = 0, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), completion, index)


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    tokens, logprobs = Sampler().sample(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert tokens == [1, 0]
    assert logprobs == [None, None]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(1, 50, generator=gen)
    others = torch.randn(5, 50, generator=gen)
    params = dict(temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    alone = [Sampler(seed=1).sample(target, [row(i, **params)])[0][0] for i in range(30)]
    crowd = []
    for i in range(30):
        logits = torch.cat([others[:2], target, others[2:]])
        rows = [row(i), row(i, temperature=0.5), row(i, **params), row(7, seed=9), row(i, temperature=0.0), row(2)]
        crowd.append(Sampler(seed=99).sample(logits, rows)[0][2])
    assert alone == crowd
    assert len(set(alone)) > 3  # it is sampling, not collapsing to the argmax
    other_seed = [Sampler().sample(target, [row(i, **{**params, "seed": 4321})])[0][0] for i in range(30)]
    assert other_seed != alone
    # n > 1: completions of one seeded request draw different streams.
    second = [Sampler().sample(target, [row(i, completion=1, **params)])[0][0] for i in range(30)]
    assert second != alone


def test_samples_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().expand(n, 4)
    tokens, _ = Sampler().sample(logits, [row(i, seed=5) for i in range(n)])
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize(
    ("top_k", "top_p", "allowed"),
    [(2, 1.0, {0, 1}), (0, 0.75, {0, 1}), (0, 0.85, {0, 1, 2}), (1, 1.0, {0}), (3, 0.6, {0, 1}), (0, 0.3, {0})],
)
def test_top_k_and_top_p_keep_exactly_the_right_tokens(top_k, top_p, allowed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 600
    logits = probs.log().expand(n, 4)
    tokens, _ = Sampler().sample(logits, [row(i, seed=11, top_k=top_k, top_p=top_p) for i in range(n)])
    assert set(tokens) == allowed
    # Within the kept set the relative odds are unchanged.
    if allowed == {0, 1}:
        share = sum(t == 0 for t in tokens) / n
        assert share == pytest.approx(0.5 / 0.8, abs=0.06)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0]).expand(2000, 3)
    cold = Sampler().sample(logits, [row(i, seed=3, temperature=0.2) for i in range(2000)])[0]
    hot = Sampler().sample(logits, [row(i, seed=3, temperature=5.0) for i in range(2000)])[0]
    assert cold.count(0) > 1900
    assert min(hot.count(t) for t in range(3)) > 400


def test_logprobs_of_the_raw_distribution_with_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    tokens, logprobs = Sampler().sample(logits, [row(temperature=0.0, logprobs=2)])
    expected = torch.log_softmax(logits[0], dim=-1)
    lp = logprobs[0]
    assert lp.token_id == tokens[0] == 1
    assert lp.logprob == pytest.approx(expected[1].item())
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([expected[1].item(), expected[2].item()])
    # Sampled (not greedy) token: its own logprob is reported even when outside the top list.
    tokens, logprobs = Sampler().sample(logits, [row(seed=0, temperature=50.0, logprobs=0)])
    assert logprobs[0].top == ()
    assert logprobs[0].logprob == pytest.approx(expected[tokens[0]].item())


@pytest.mark.parametrize(
    "bad",
    [dict(n=0), dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(max_tokens=0), dict(logprobs=21),
     dict(stop=[""]), dict(stop=["x"], detokenize=False)],
)  # fmt: skip
def test_invalid_params_are_refused(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad)
