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
    seed: int | None = None  # reproducible sampling, independent of what else is in the batch
    max_tokens: int | None = 16  # None: until the model's context is full
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k alternatives
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, "n", "n must be >= 1"),
            (self.temperature >= 0.0, "temperature", "temperature must be >= 0"),
            (self.top_k >= 0, "top_k", "top_k must be >= 0 (or -1 for no limit)"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (self.detokenize or not self.stop, "stop", "stop strings need detokenize=True"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
