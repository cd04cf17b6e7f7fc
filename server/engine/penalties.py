"""Repetition, frequency and presence penalties, logit bias and min-p: batched, for the rows that ask only.

Semantics (those of OpenAI and vLLM):
- ``repetition_penalty`` r (vLLM/transformers): a token seen in the prompt or the output so far has its logit
  divided by r when positive and multiplied by r when negative.
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI): ``logit -= f * count + p * (count > 0)`` where
  ``count`` is how often the token occurs in the completion's output so far (not the prompt).
- ``logit_bias`` (OpenAI): a constant added to the named tokens' logits.
- ``min_p`` (vLLM): after temperature, tokens with probability below ``min_p`` times the top token's are dropped.

Penalties read per-completion token counts that :class:`TokenCounts` keeps on the logits' device and updates
with every sampled token, so no step recounts a completion's tokens. The counts of a step's penalised rows are
rows of one ``[P, vocab]`` buffer; while the same completions are sampled together (steady decoding) each step
reads and updates that buffer in place, and a changed batch costs one stacked copy.
"""

from __future__ import annotations

import torch

from server.engine.sampling_params import SamplingParams


class TokenCounts:
    """One completion's output-token counts (and prompt-token set) for its penalties, built on first use."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self._token_ids = token_ids  # the sequence's own list (prompt + output), appended by the engine
        self._num_prompt_tokens = num_prompt_tokens
        self.output: torch.Tensor | None = None  # [vocab] int32: occurrences of each token in the output
        self.prompt: torch.Tensor | None = None  # [vocab] bool: the token occurs in the prompt
        self.num_counted = 0  # output tokens reflected in ``output``
        self.buffer: torch.Tensor | None = None  # the [P, vocab] buffer ``output`` is row ``row`` of, if any
        self.row = 0

    def sync(self, num_output_tokens: int, vocab: int, device: torch.device) -> None:
        """Make the counts cover exactly the first ``num_output_tokens`` output tokens (a recount only when a
        sampled token was never appended, or on first use)."""
        if self.output is not None and self.num_counted == num_output_tokens and self.output.device == device:
            return
        start = self._num_prompt_tokens
        output = torch.tensor(self._token_ids[start : start + num_output_tokens], dtype=torch.long, device=device)
        self.output = torch.bincount(output, minlength=vocab)[:vocab].to(torch.int32)
        prompt = torch.tensor(self._token_ids[:start], dtype=torch.long, device=device)
        self.prompt = torch.bincount(prompt, minlength=vocab)[:vocab] > 0
        self.num_counted = num_output_tokens
        self.buffer = None


def _batched(counts: list[TokenCounts]) -> torch.Tensor:
    """The rows' output counts as one ``[P, vocab]`` tensor: their shared buffer when they already are exactly
    its rows in order (no copy), else a stacked copy whose rows they view from then on."""
    buffer = counts[0].buffer
    in_place = buffer is not None and buffer.shape[0] == len(counts)
    if in_place and all(c.buffer is buffer and c.row == i for i, c in enumerate(counts)):
        return buffer
    buffer = torch.stack([c.output for c in counts])
    for i, (c, row) in enumerate(zip(counts, buffer.unbind(0), strict=True)):
        c.output, c.buffer, c.row = row, buffer, i
    return buffer


def apply_penalties(
    logits: torch.Tensor, counts: list[TokenCounts], params: list[SamplingParams], token_index: list[int]
) -> torch.Tensor:
    """Penalised copies of ``logits`` ``[P, vocab]``, one row per completion in ``counts``."""
    vocab, device = logits.shape[1], logits.device
    for c, n in zip(counts, token_index, strict=True):
        c.sync(n, vocab, device)
    output = _batched(counts)
    seen = output > 0
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        r = torch.tensor(rep, device=device, dtype=logits.dtype)[:, None]
        repeated = seen | torch.stack([c.prompt for c in counts])
        logits = torch.where(repeated, torch.where(logits > 0, logits / r, logits * r), logits)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=logits.dtype)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device, dtype=logits.dtype)[:, None]
    return logits - freq * output.to(logits.dtype) - pres * seen.to(logits.dtype)


def record_tokens(counts: list[TokenCounts], token_ids: list[int]) -> None:
    """Count each completion's newly sampled token: one batched in-place update of their buffer."""
    if not counts:
        return
    output = _batched(counts)
    rows = torch.arange(len(counts), device=output.device)
    output[rows, torch.tensor(token_ids, device=output.device)] += 1
    for c in counts:
        c.num_counted += 1


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float]]) -> torch.Tensor:
    """``logits`` ``[P, vocab]`` plus each row's bias (a copy); the loop runs over the bias entries only."""
    rows = [i for i, bias in enumerate(biases) for _ in bias]
    tokens = [t for bias in biases for t in bias]
    values = [v for bias in biases for v in bias.values()]
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
    return logits.index_put(index, torch.tensor(values, device=device, dtype=logits.dtype), accumulate=True)


def apply_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Zero tokens below ``min_p`` times the row's top probability, then renormalise (so top-p sees a
    distribution); a row with ``min_p == 0`` keeps every token."""
    threshold = torch.tensor(min_p, device=probs.device, dtype=probs.dtype)[:, None] * probs.amax(-1, keepdim=True)
    kept = probs * (probs >= threshold)
    return kept / kept.sum(-1, keepdim=True)
