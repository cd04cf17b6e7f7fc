"""Per-request sampling parameters (the OpenAI/vLLM set we support)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.errors import InvalidRequest

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1): no limit
    top_p: float = 1.0
    min_p: float = 0.0  # vLLM: drop tokens below min_p x the top token's probability
    seed: int | None = None  # reproducible sampling, independent of what else is in the batch
    max_tokens: int | None = 16  # None: until the model's context is full
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM: divides (multiplies, if negative) logits of prompt and output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI: token id -> added to its logit
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k alternatives
    skip_special_tokens: bool = True
    detokenize: bool = True
    json_schema: str | None = None  # structured outputs: canonical JSON-schema text every completion must match
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) every completion must match: forced tool calls

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids)
        self.logit_bias = dict(self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, "n", "n must be >= 1"),
            (self.temperature >= 0.0, "temperature", "temperature must be >= 0"),
            (self.top_k >= 0, "top_k", "top_k must be >= 0 (or -1 for no limit)"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be > 0 (1: none)"),
            (
                all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
                "logit_bias",
                "logit_bias maps token ids (>= 0) to biases in [-100, 100]",
            ),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (self.detokenize or not self.stop, "stop", "stop strings need detokenize=True"),
            (not (self.json_schema and self.grammar), "response_format", "response_format cannot add to a grammar"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty applies, so the completion needs its token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
