"""How many prompt tokens a step may carry beside running decodes, from what steps have cost lately.

A step's duration is the inter-token latency of every stream it decodes, so prompt chunks beside decodes
stretch it. The budget bounds the stretch in time, not tokens: a step carrying prompt chunks may take at most
``stretch`` times what a decode-only step with the same decodes takes, T(D). The same rule gives a few dozen
tokens on a CPU and hundreds on a GPU, and more as more streams decode (T(D) grows, so does the room beside
it). The token cap (``--step-tokens-while-decoding``) bounds the budget and a page is its floor.

Within the stretch, the budget follows the prompt backlog (tokens of prompts started or waiting): enough to
clear it in ``BACKLOG_STEPS`` steps, but never less than ``min_stretch`` allows nor more than ``stretch``. Streams
then step steadily while prompts arrive one at a time (a chat or streaming load: a prompt takes a few steps
more), and prompt-heavy loads, whose waiting prompts' TTFT is what is at stake, get the larger chunks.

The costs are learned online, per server (pure Python, no tensors): T(D) as a weighted least-squares line
over decode-only steps, a prompt token's cost as (step time - T(D)) per prompt token over steps that carried
prompts, weighted by tokens. Both forget with a half-life of ``half_life_steps``, so they follow the load, the
thread count and the device. Until both have been seen, the static cap applies.
"""

from __future__ import annotations

DEFAULT_STRETCH = 3.0  # prompt chunks may add twice a decode-only step when prompts back up ...
DEFAULT_MIN_STRETCH = 1.5  # ... and half of one while the backlog clears anyway (docs/performance.md: measurements)
BACKLOG_STEPS = 16  # steps in which the budget aims to clear the prompt backlog
MIN_DECODE_WEIGHT = 4.0  # decode-only steps (decayed count) before T(D) is trusted
MIN_SLOPE_SPREAD = 0.25  # variance of D below which T(D) is taken as flat (the slope is not identifiable)


class StepCosts:
    """Online estimates of a decode-only step's time and a prompt token's time, and the budget they imply."""

    def __init__(
        self, stretch: float = DEFAULT_STRETCH, min_stretch: float = DEFAULT_MIN_STRETCH, half_life_steps: float = 64.0
    ) -> None:
        if stretch <= 1.0 or min_stretch <= 1.0:
            raise ValueError("a step's stretch must be above 1 (1 would leave no time for prompts)")
        self.stretch = stretch
        self.min_stretch = min(min_stretch, stretch)
        self._keep = 0.5 ** (1.0 / half_life_steps)
        # Decayed sums over decode-only steps of 1, D, t, D^2, D*t.
        self._n = self._sd = self._st = self._sdd = self._sdt = 0.0
        # Decayed sums over steps with prompt tokens: prompt tokens and their share of the time.
        self._tokens = self._token_seconds = 0.0

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        """One step ran ``decodes`` single-token decodes and ``prompt_tokens`` prompt tokens in ``seconds``."""
        if prompt_tokens == 0:
            if decodes:
                keep = self._keep
                self._n = self._n * keep + 1.0
                self._sd = self._sd * keep + decodes
                self._st = self._st * keep + seconds
                self._sdd = self._sdd * keep + decodes * decodes
                self._sdt = self._sdt * keep + decodes * seconds
            return
        decode_part = self.decode_seconds(decodes)  # for no decodes, the line's intercept: a step's fixed cost
        if decode_part is None:
            return  # the rest of this step's time is unknown yet
        # Weighted by tokens: a long chunk says more about a token's cost than a short one.
        self._tokens = self._tokens * self._keep + prompt_tokens
        self._token_seconds = self._token_seconds * self._keep + max(0.0, seconds - decode_part)

    def decode_seconds(self, decodes: int) -> float | None:
        """T(decodes): a decode-only step's expected time; None until enough such steps were seen."""
        if self._n < MIN_DECODE_WEIGHT:
            return None
        mean_d, mean_t = self._sd / self._n, self._st / self._n
        spread = self._sdd / self._n - mean_d * mean_d
        slope = (self._sdt / self._n - mean_d * mean_t) / spread if spread > MIN_SLOPE_SPREAD else 0.0
        return max(0.0, mean_t + max(0.0, slope) * (decodes - mean_d))

    def prompt_token_seconds(self) -> float | None:
        """A prompt token's expected share of a step's time; None until a step with prompt tokens was seen."""
        return self._token_seconds / self._tokens if self._tokens > 0 else None

    def prompt_budget(self, decodes: int, most: int, floor: int, backlog: int | None = None) -> int:
        """Prompt tokens a step may carry beside ``decodes`` decodes: a ``BACKLOG_STEPS``-th of the ``backlog``
        (prompt tokens left to compute; None: as much as the stretch allows), within what fits in
        ``min_stretch - 1`` to ``stretch - 1`` decode-only steps, and within ``[floor, most]`` (a page; the token
        cap's room)."""
        decode_part, per_token = self.decode_seconds(decodes), self.prompt_token_seconds()
        if not decodes or decode_part is None or not per_token:
            return most  # nothing decodes, costs not learned yet, or prompt tokens cost nothing measurable
        tokens_per_stretch = decode_part / per_token  # prompt tokens that take as long as a decode-only step
        wanted = (self.stretch - 1.0) * tokens_per_stretch
        if backlog is not None:
            wanted = min(wanted, max((self.min_stretch - 1.0) * tokens_per_stretch, backlog / BACKLOG_STEPS))
        return max(floor, min(most, int(wanted)))
