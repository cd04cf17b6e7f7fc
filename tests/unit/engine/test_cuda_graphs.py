"""The decode graphs' bookkeeping, in plain Python: which batch sizes are captured and which steps replay which.

What the padded replay computes is checked against PEFT in tests/integration/engine/test_peft_parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.engine.cuda_graphs import DecodeGraphs, graph_buckets
from server.engine.scheduler import ScheduledSequence, SchedulerOutput


def test_buckets_are_powers_of_two_then_multiples_of_eight_up_to_the_largest():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(5) == (1, 2, 4, 5)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(30) == (1, 2, 4, 8, 16, 24, 30)
    assert graph_buckets(256)[-3:] == (240, 248, 256) and len(graph_buckets(256)) == 35
    with pytest.raises(ValueError):
        graph_buckets(0)


def _step(*tokens_and_blocks: tuple[int, int]) -> SchedulerOutput:
    """A step of sequences given as (new tokens, block-table length)."""
    seqs = [SimpleNamespace(block_table=[0] * blocks) for _, blocks in tokens_and_blocks]
    return SchedulerOutput([ScheduledSequence(seq, n) for seq, (n, _) in zip(seqs, tokens_and_blocks, strict=True)])


def _graphs(buckets: tuple[int, ...], max_blocks: int) -> DecodeGraphs:
    graphs = DecodeGraphs.__new__(DecodeGraphs)  # the bookkeeping alone: no model, buffers or pool
    graphs.buckets, graphs.max_blocks = buckets, max_blocks
    return graphs


def test_a_decode_step_replays_the_smallest_bucket_that_holds_it():
    graphs = _graphs(graph_buckets(24), max_blocks=4)
    assert [graphs.bucket_for(_step(*[(1, 2)] * n)) for n in (1, 2, 3, 4, 5, 8, 9, 17, 24)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        24,
        24,
    ]


def test_steps_with_prompt_tokens_too_many_sequences_or_long_contexts_run_eagerly():
    graphs = _graphs(graph_buckets(8), max_blocks=4)
    assert graphs.bucket_for(_step((1, 2), (7, 2))) is None  # a prompt chunk beside a decode
    assert graphs.bucket_for(_step(*[(1, 1)] * 9)) is None  # past the largest bucket
    assert graphs.bucket_for(_step((1, 4), (1, 5))) is None  # a context wider than the graphs' block tables
    assert graphs.bucket_for(_step((1, 4), (1, 4))) == 2
    assert graphs.bucket_for(SchedulerOutput([])) is None
