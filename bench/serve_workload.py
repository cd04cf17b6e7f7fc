"""The serving benchmark's requests: adapters drawn with Zipf popularity, prompt and output lengths from a seed.

Every system sees the same request sequence: it depends only on the seed and the arguments, never on
timing, so a closed loop of clients replays it identically against each server.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

# Prompt token ids are drawn from this range: the tiny model's byte tokens (ids 4..259), and ordinary
# (non-special) tokens of any real vocabulary.
PROMPT_TOKEN_RANGE = (4, 260)


@dataclass(frozen=True)
class LengthRange:
    """Inclusive ``lo..hi``; lengths are drawn uniformly from it."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"length range {self.lo}:{self.hi} must satisfy 1 <= lo <= hi")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"16:128"`` (a range) or ``"32"`` (a fixed length)."""
        lo, _, hi = text.partition(":")
        return cls(int(lo), int(hi or lo))

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class WorkItem:
    """One request: which adapter (index by popularity rank, 0 most popular), its prompt ids, tokens to generate."""

    index: int
    adapter: int
    prompt: list[int]
    max_tokens: int


def zipf_weights(num_adapters: int, exponent: float) -> list[float]:
    """Probability of each adapter by popularity rank: ``P(k) ∝ 1 / k**exponent`` (exponent 0: uniform)."""
    if num_adapters < 1:
        raise ValueError("need at least one adapter")
    if exponent < 0:
        raise ValueError("the Zipf exponent must be >= 0")
    raw = [1.0 / (rank**exponent) for rank in range(1, num_adapters + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def workload(
    num_adapters: int, zipf_exponent: float, prompt_len: LengthRange, output_len: LengthRange, seed: int
) -> Iterator[WorkItem]:
    """An endless, seeded request sequence; take as many as the run needs."""
    rng = random.Random(seed)
    weights = zipf_weights(num_adapters, zipf_exponent)
    adapters = range(num_adapters)
    index = 0
    while True:
        adapter = rng.choices(adapters, weights)[0]
        prompt = [rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(prompt_len.draw(rng))]
        yield WorkItem(index, adapter, prompt, output_len.draw(rng))
        index += 1
