"""Token selection: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

A seeded row draws its noise from a generator keyed by (seed, completion index, token index), and
every transformation is row-wise, so its tokens do not depend on what else is in the batch (nor on
preemption). Sampling uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` draws a token
with probability ``p``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from server.engine.outputs import TokenLogprob
from server.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One row of the logits: its parameters and which token of which completion it produces."""

    params: SamplingParams
    completion_index: int
    token_index: int  # number of tokens this completion has generated so far


def seed_for(seed: int, completion_index: int, token_index: int) -> int:
    """A 63-bit generator seed derived deterministically from the request seed and the token's place."""
    digest = hashlib.blake2b(f"{seed}:{completion_index}:{token_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Sampler:
    """Samples one token per row of fp32 logits ``[N, vocab]``."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for rows without a seed

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Token ids and, for rows that asked, their logprobs."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            picked = self._sample_random(logits[index], [rows[i] for i in random_rows])
            tokens[index] = picked
        token_ids = tokens.tolist()
        return token_ids, self._logprobs(logits, rows, token_ids)

    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any(r.params.top_k or r.params.top_p < 1.0 for r in rows):
            probs = self._truncate(probs, rows)
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            seed = row.params.seed
            gen = self.generator
            if seed is not None:
                gen = torch.Generator().manual_seed(seed_for(seed, row.completion_index, row.token_index))
            noise[i] = torch.empty(probs.shape[1]).exponential_(generator=gen).to(probs.device)
        return (probs / noise).argmax(dim=-1)

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
