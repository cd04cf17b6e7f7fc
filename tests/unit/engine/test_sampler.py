"""Sampler: greedy, seeded reproducibility independent of the batch, top-k/top-p/min-p, penalties, logit bias,
logprobs."""

from __future__ import annotations

import pytest
import torch

from core.errors import InvalidRequest
from server.engine.penalties import TokenCounts, apply_logit_bias, apply_min_p, apply_penalties
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


@pytest.mark.parametrize("use_c", [True, False], ids=["c-loop", "torch"])
@pytest.mark.parametrize("vocab", [96, 100, 1000])  # whole words, a partial last word, more tokens than the mask
def test_a_bitmask_forbids_exactly_its_clear_bits_on_its_rows(use_c, vocab):
    from server.engine.grammar import apply_bitmask_

    gen = torch.Generator().manual_seed(vocab)
    words = min(-(-vocab // 32), 20)  # vocab 1000: tokens from 640 on are past the mask (forbidden)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    bitmask[0, 0], bitmask[1, 1] = -1, 0  # an all-allowed and an all-forbidden word
    logits = torch.randn(5, vocab, generator=gen)
    rows = [3, 0, 4]
    expected = logits.clone()
    for i, r in enumerate(rows):
        for t in range(vocab):
            if t >= words * 32 or not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    apply_bitmask_(logits, rows, bitmask, use_c=use_c)
    assert torch.equal(logits, expected)


def test_constrained_rows_are_masked_and_free_rows_untouched(tiny_model_dir):
    """A grammar's mask (a bitmask filled per constrained row) applies to its row only, greedy or sampled."""
    from transformers import AutoTokenizer

    from server.engine.grammar import GrammarCache, canonical_schema

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = len(tokenizer)
    cache = GrammarCache(tokenizer, vocab, [tokenizer.eos_token_id])
    schema = canonical_schema({"enum": ["yes", "no"]})
    quote, y, n = (
        tokenizer('"', add_special_tokens=False).input_ids[0],
        *tokenizer("yn", add_special_tokens=False).input_ids,
    )
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, vocab, generator=gen)
    logits[:, tokenizer.eos_token_id] = 50.0  # EOS is the model's favourite: the grammar must still forbid it
    free = [row(temperature=0.0), row(temperature=0.7, seed=5)]
    matchers = [cache.matcher(schema), cache.matcher(schema)]
    rows = [
        free[0],
        SamplingRow(SamplingParams(temperature=0.0, logprobs=1), 0, 0, matchers[0]),
        free[1],
        SamplingRow(SamplingParams(temperature=1.0, seed=1), 0, 0, matchers[1]),
    ]
    tokens, logprobs = Sampler().sample(logits.clone(), rows)
    assert tokens[1] == tokens[3] == quote  # an enum of strings must open with a quote
    alone, _ = Sampler().sample(logits[[0, 2]].clone(), free)
    assert [tokens[0], tokens[2]] == alone == [tokenizer.eos_token_id, alone[1]]
    assert logprobs[1].top[0][0] == tokenizer.eos_token_id  # logprobs are the model's, not the mask's
    for matcher in matchers:
        matcher.consume_token(quote)
    tokens, _ = Sampler().sample(logits[[1, 3]].clone(), [rows[1], rows[3]])
    assert set(tokens) <= {y, n}
    assert cache.compilations == 1  # both completions shared one compiled grammar


# ----- penalties, logit bias, min-p ------------------------------------------------------------------------


def reference_penalties(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0):
    """The formulas written out token by token: vLLM's repetition penalty, then OpenAI's two penalties."""
    out = logits.clone()
    for token in range(out.shape[0]):
        count = output.count(token)
        if repetition != 1.0 and (token in prompt or count):
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        out[token] -= frequency * count + presence * (count > 0)
    return out


def counted_row(prompt, output, completion=0, **params) -> SamplingRow:
    """A row whose completion has generated ``output`` after ``prompt``, with its own token counts."""
    ids = list(prompt) + list(output)
    return SamplingRow(SamplingParams(**params), completion, len(output), counts=TokenCounts(ids, len(prompt)))


PENALTY_CASES = [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(frequency_penalty=-0.5, presence_penalty=0.3),
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6, frequency_penalty=0.2),
]


@pytest.mark.parametrize("knobs", PENALTY_CASES)
def test_penalised_logits_equal_the_reference_formula(knobs):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 12, generator=gen) * 3
    prompt, output = [1, 2, 2, 9], [3, 3, 3, 1, 7]
    rows = [counted_row(prompt, output, **knobs), counted_row([5], [], **knobs)]
    got = apply_penalties(logits, [r.counts for r in rows], [r.params for r in rows], [r.token_index for r in rows])
    renamed = {k.removesuffix("_penalty"): v for k, v in knobs.items()}
    assert torch.allclose(got[0], reference_penalties(logits[0], prompt, output, **renamed))
    assert torch.allclose(got[1], reference_penalties(logits[1], [5], [], **renamed))


@pytest.mark.parametrize("knobs", PENALTY_CASES[:2] + PENALTY_CASES[3:4])
def test_sampling_follows_the_penalised_distribution(knobs):
    logits = torch.tensor([1.0, 0.5, 0.0, 0.8])
    prompt, output = [2], [0, 0, 1]
    renamed = {k.removesuffix("_penalty"): v for k, v in knobs.items()}
    expected = torch.softmax(reference_penalties(logits, prompt, output, **renamed), dim=-1)
    n = 4000
    rows = [counted_row(prompt, output, completion=i, seed=5, **knobs) for i in range(n)]
    tokens, _ = Sampler().sample(logits.expand(n, 4), rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert torch.allclose(freq, expected, atol=0.03)
    # Greedy picks the penalised argmax: the repeated favourite gives way.
    greedy, _ = Sampler().sample(logits[None], [counted_row(prompt, output, temperature=0.0, **knobs)])
    assert greedy == [int(expected.argmax())] == [3]


def test_logit_bias_is_added_to_the_named_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = {0: -100.0, 3: 2.5}
    assert torch.equal(apply_logit_bias(logits, [bias]), torch.tensor([[-98.0, 1.0, 0.0, 1.5]]))
    assert Sampler().sample(logits, [row(temperature=0.0, logit_bias={3: 100.0})])[0] == [3]
    assert Sampler().sample(logits, [row(temperature=0.0, logit_bias={0: -100.0})])[0] == [1]
    n = 4000
    tokens, _ = Sampler().sample(logits.expand(n, 4), [row(i, seed=2, logit_bias=bias) for i in range(n)])
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0] + torch.tensor([-100.0, 0, 0, 2.5]), dim=-1), atol=0.03)


@pytest.mark.parametrize(("min_p", "allowed"), [(0.0, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_keeps_tokens_above_a_share_of_the_top_one(min_p, allowed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 2000
    tokens, _ = Sampler().sample(probs.log().expand(n, 4), [row(i, seed=8, min_p=min_p) for i in range(n)])
    assert set(tokens) == allowed
    kept = apply_min_p(probs[None], [min_p])[0]
    expected = probs * torch.tensor([t in allowed for t in range(4)])
    assert torch.allclose(kept, expected / expected.sum())


def test_neutral_knobs_change_nothing_and_cost_nothing():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 30, generator=gen)
    neutral = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}, min_p=0.0)
    assert not SamplingParams(**neutral).penalised
    plain = [row(temperature=0.0), row(3, seed=1), row(5, seed=2, top_p=0.8)]
    knobbed = [row(temperature=0.0, **neutral), row(3, seed=1, **neutral), row(5, seed=2, top_p=0.8, **neutral)]
    assert Sampler().sample(logits, plain)[0] == Sampler().sample(logits, knobbed)[0]
    assert Sampler._adjust(logits, knobbed) is logits  # no copy, no work


def test_mixed_batches_give_each_row_what_it_gets_alone():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 40, generator=gen) * 2
    prompt, output = [1, 4, 4], [7, 7, 2, 9, 1]

    def rows():  # fresh counts each time: sampling advances them
        return [
            row(5, temperature=0.0),
            counted_row(prompt, output, seed=3, frequency_penalty=1.0, presence_penalty=0.5),
            row(5, seed=4, logit_bias={7: 3.0, 8: -2.0}, min_p=0.1),
            counted_row(prompt, output, temperature=0.0, repetition_penalty=1.3, logit_bias={2: 1.0}),
            row(5, seed=4),
            counted_row(prompt, output, seed=9, repetition_penalty=1.2, min_p=0.05, top_k=10),
        ]

    together, _ = Sampler(seed=1).sample(logits, rows())
    alone = [Sampler(seed=2).sample(logits[i : i + 1], [r])[0][0] for i, r in enumerate(rows()) if i != 4]
    assert [t for i, t in enumerate(together) if i != 4] == alone  # row 4 is unseeded: it draws from the sampler


def test_token_counts_advance_with_each_sampled_token():
    prompt, output = [3, 3], [1]
    ids = prompt + output
    counts = TokenCounts(ids, len(prompt))
    sampler, logits = Sampler(), torch.tensor([[0.0, 5.0, 4.5, 1.0]])
    for _ in range(4):
        params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
        token = sampler.sample(logits, [SamplingRow(params, 0, len(ids) - len(prompt), counts=counts)])[0][0]
        ids.append(token)  # what the engine does with it
        assert counts.num_counted == len(ids) - len(prompt)
        assert counts.output.tolist() == torch.bincount(torch.tensor(ids[2:]), minlength=4).tolist()
    assert ids[2:] == [1, 2, 1, 2, 1]  # each repeat of the leader costs it 1: 1 and 2 alternate
    # A sampled token the engine never appended (e.g. an abort) is recounted from the sequence next time.
    sampler.sample(logits, [SamplingRow(SamplingParams(presence_penalty=2.0, seed=1), 0, 4, counts=counts)])
    counts.sync(4, 4, logits.device)
    assert counts.output.tolist() == torch.bincount(torch.tensor(ids[2:6]), minlength=4).tolist()


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias={5: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
    ],
)
def test_invalid_knobs_are_refused_naming_them(bad, param):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**bad)
    assert info.value.param == param


def test_steady_decoding_updates_one_count_buffer_in_place():
    """The same penalised completions step after step share one [P, vocab] buffer: no copy per step."""
    logits = torch.tensor([[0.0, 5.0, 4.5, 1.0], [3.0, 0.0, 2.9, 0.0]])
    id_lists = [[0, 1], [2, 3]]
    counts = [TokenCounts(ids, 1) for ids in id_lists]
    sampler = Sampler()
    buffers = []
    for _ in range(4):
        rows = [
            SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=1.0), 0, len(ids) - 1, counts=c)
            for ids, c in zip(id_lists, counts, strict=True)
        ]
        for ids, token in zip(id_lists, sampler.sample(logits, rows)[0], strict=True):
            ids.append(token)
        buffers.append(counts[0].buffer)
    assert all(b is buffers[0] for b in buffers)
    for ids, c in zip(id_lists, counts, strict=True):
        assert c.output.tolist() == torch.bincount(torch.tensor(ids[1:]), minlength=4).tolist()
    # A new batch composition (one row alone, then both again) copies once and stays correct.
    alone = SamplingRow(
        SamplingParams(temperature=0.0, frequency_penalty=1.0), 0, len(id_lists[1]) - 1, counts=counts[1]
    )
    id_lists[1].append(sampler.sample(logits[1:], [alone])[0][0])
    assert counts[1].output.tolist() == torch.bincount(torch.tensor(id_lists[1][1:]), minlength=4).tolist()
    assert counts[0].output.tolist() == torch.bincount(torch.tensor(id_lists[0][1:]), minlength=4).tolist()
