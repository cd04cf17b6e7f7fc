"""Token selection: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, per-request seeds, logprobs.

Sampling inverts each row's CDF at one uniform number: the first token whose cumulative probability exceeds
``u * total``. A seeded row's ``u`` is a hash of (seed, completion index, token index), and every transformation
is row-wise, so its tokens do not depend on what else is in the batch (nor on preemption). One number per row
instead of a noise vector over the vocabulary keeps the whole batch in a few vectorised ops (a per-row
exponential race cost 0.8 ms a row at a 32k vocabulary, more than the tiny benchmark model's forward).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from server.engine.grammar import TokenMasks
from server.engine.outputs import TokenLogprob
from server.engine.penalties import TokenCounts, apply_logit_bias, apply_min_p, apply_penalties, record_tokens
from server.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One row of the logits: its parameters and which token of which completion it produces."""

    params: SamplingParams
    completion_index: int
    token_index: int  # number of tokens this completion has generated so far
    matcher: Any = None  # structured outputs: the completion's grammar matcher; None for free rows
    counts: TokenCounts | None = None  # penalties: the completion's token counts; None when it has no penalty


def seed_for(seed: int, completion_index: int, token_index: int) -> int:
    """A 63-bit generator seed derived deterministically from the request seed and the token's place."""
    digest = hashlib.blake2b(f"{seed}:{completion_index}:{token_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _hash_uniform(seed: int, completion_index: int, token_index: int) -> float:
    """A uniform in [0, 1) from the top 53 bits of the token's seed hash."""
    return (seed_for(seed, completion_index, token_index) >> 10) * 2.0**-53


class Sampler:
    """Samples one token per row of fp32 logits ``[N, vocab]``."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for rows without a seed
        self.masks = TokenMasks()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Token ids and, for rows that asked, their logprobs."""
        logits = logits.float()
        raw = logits
        logits = self._adjust(logits, rows)
        logits = self._constrain(logits, rows)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random_rows:
            token_ids = logits.argmax(dim=-1).tolist()
        elif len(random_rows) == len(rows):
            token_ids = self._sample_random(logits, rows).tolist()
        else:
            greedy_rows = [i for i, row in enumerate(rows) if row.params.greedy]
            token_ids = [0] * len(rows)
            greedy = logits[torch.tensor(greedy_rows, device=logits.device)].argmax(dim=-1).tolist()
            index = torch.tensor(random_rows, device=logits.device)
            picked = self._sample_random(logits[index], [rows[i] for i in random_rows]).tolist()
            for i, token in (*zip(greedy_rows, greedy, strict=True), *zip(random_rows, picked, strict=True)):
                token_ids[i] = token
        counted = [i for i, row in enumerate(rows) if row.counts is not None]
        record_tokens([rows[i].counts for i in counted], [token_ids[i] for i in counted])
        return token_ids, self._logprobs(raw, rows, token_ids)

    @staticmethod
    def _adjust(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Logit bias, then penalties, on the rows that ask (a copy); without them no row costs anything.

        Logprobs stay those of the model, as in vLLM.
        """
        biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
        penalised = [i for i, row in enumerate(rows) if row.counts is not None]
        if not biased and not penalised:
            return logits
        logits = logits.clone()
        if biased:
            index = torch.tensor(biased, device=logits.device)
            logits[index] = apply_logit_bias(logits[index], [rows[i].params.logit_bias for i in biased])
        if penalised:
            index = torch.tensor(penalised, device=logits.device)
            logits[index] = apply_penalties(
                logits[index],
                [rows[i].counts for i in penalised],
                [rows[i].params for i in penalised],
                [rows[i].token_index for i in penalised],
            )
        return logits

    def _constrain(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Structured outputs: -inf for what a row's grammar forbids (EOS included until it is complete).

        One batched mask over the constrained rows; free rows are not touched. Logprobs stay those of the model.
        """
        constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
        if not constrained:
            return logits
        if any(row.params.logprobs is not None for row in rows):
            logits = logits.clone()
        self.masks.apply_(logits, constrained, [rows[i].matcher for i in constrained])
        return logits

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any(r.params.min_p > 0.0 for r in rows):
            probs = apply_min_p(probs, [r.params.min_p for r in rows])
        if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
            probs = self._truncate(probs, rows)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        target = self._uniforms(rows).to(probs.device, non_blocking=True) * cdf[:, -1]
        picked = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
        # u * total can round up to total: never step past the last token that has any probability (the first
        # place the running sum reaches the total).
        last = torch.searchsorted(cdf, cdf[:, -1:].contiguous())[:, 0]
        return torch.minimum(picked, last)

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One uniform in [0, 1) per row (float64, CPU): from the row's seed, else from the sampler's generator."""
        drawn = torch.rand(len(rows), generator=self.generator, dtype=torch.float64).tolist()
        return torch.tensor(
            [
                drawn[i]
                if row.params.seed is None
                else _hash_uniform(row.params.seed, row.completion_index, row.token_index)
                for i, row in enumerate(rows)
            ],
            dtype=torch.float64,
        )

    @staticmethod
    def _truncate(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Zero what top-k and top-p exclude (the most likely token always survives); no renormalising needed."""
        vocab = probs.shape[1]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=probs.device)[None, :]
        top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=probs.device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=probs.device, dtype=probs.dtype)
        # Keep a token if fewer than top_p of the mass lies strictly before it in sorted order.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = (rank < top_k[:, None]) & ((mass_before < top_p[:, None]) | (rank == 0))
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]) -> list[TokenLogprob | None]:
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(rows)
        if not wanted:
            return result
        index = torch.tensor(wanted, device=logits.device)
        logp = torch.log_softmax(logits[index], dim=-1)
        chosen = logp.gather(1, torch.tensor([[token_ids[i]] for i in wanted], device=logits.device))[:, 0].tolist()
        k = max(rows[i].params.logprobs for i in wanted)
        top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
            result[i] = TokenLogprob(token_ids[i], chosen[j], top)
        return result
