"""What rank 0 sends its followers, and how a follower turns a step back into the runner's input.

A step travels as what :meth:`ModelRunner.prepare` reads of each scheduled sequence (its new tokens, where they
start, its block table, its adapter slot, whether it samples), so every rank fills its step buffers with the one
``prepare``; followers never see prompts, sampling parameters or tenants. Adapter placements travel as the page
ids and slot rank 0 chose, with each rank's page images: the layout is the same on every rank (:mod:`.shards`).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.scheduler import ScheduledSequence, SchedulerOutput
from server.memory.adapter_pages import AdapterPlan


@dataclass(frozen=True)
class StepSequence:
    """One scheduled sequence as a step's forward needs it."""

    new_tokens: list[int]
    start: int  # tokens already computed: the first new token's position
    block_table: list[int]
    adapter_slot: int
    samples: bool


@dataclass(frozen=True)
class Step:
    sequences: list[StepSequence]
    all_logits: bool = False  # the logits of every row, not only the sampled ones (tests compare whole steps)

    @classmethod
    def of(cls, batch: SchedulerOutput, all_logits: bool = False) -> Step:
        return cls(
            [
                StepSequence(
                    item.seq.token_ids[
                        item.seq.num_computed_tokens : item.seq.num_computed_tokens + item.num_new_tokens
                    ],
                    item.seq.num_computed_tokens,
                    list(item.seq.block_table),
                    item.seq.adapter_slot,
                    item.samples,
                )
                for item in batch.scheduled
            ],
            all_logits,
        )

    def batch(self) -> SchedulerOutput:
        """The step as the runner takes it, over stand-ins that hold only this step's tokens."""
        return SchedulerOutput([ScheduledSequence(_FollowerSequence(s), len(s.new_tokens)) for s in self.sequences])


class _NewTokens:
    """A follower sequence's ``token_ids``: only the step's new tokens, addressed by their positions."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, span: slice) -> list[int]:
        return self.tokens[span.start - self.start : span.stop - self.start]


class _FollowerSequence:
    """What the runner reads of a sequence (``prepare``, the graphs' bucket), nothing more."""

    def __init__(self, s: StepSequence) -> None:
        self.token_ids = _NewTokens(s.start, s.new_tokens)
        self.num_computed_tokens = s.start
        # ScheduledSequence.samples: the step computes the last known token.
        self.num_tokens = s.start + len(s.new_tokens) + (0 if s.samples else 1)
        self.block_table = s.block_table
        self.adapter_slot = s.adapter_slot
        self.matcher = None


@dataclass(frozen=True)
class Placement:
    """An adapter rank 0 placed: the slot and pages it took, and the plan with every follower's page images."""

    slot: int
    pages: list[int]
    plan: AdapterPlan  # its own image left out: followers write ``rank_images[rank - 1]``


@dataclass(frozen=True)
class Cleared:
    slot: int


@dataclass(frozen=True)
class Stop:
    pass
