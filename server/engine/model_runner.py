"""Turns a scheduled step into tensors, runs the model, and samples the sequences that need a token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex_kernels import NO_ADAPTER, Segments
from server.engine.outputs import TokenLogprob
from server.engine.sampler import Sampler, SamplingRow
from server.engine.scheduler import SchedulerOutput
from server.engine.sequence import Sequence
from server.memory.block_manager import blocks_for
from server.model.attention import AttentionMetadata, PrefillSpan
from server.model.llama import LlamaModel


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    segments: Segments
    logit_rows: torch.Tensor  # rows whose next-token logits are sampled
    sampled: list[Sequence]


class ModelRunner:
    """Owns the model on its device; stateless between steps apart from the KV pages it writes."""

    def __init__(
        self, model: LlamaModel, sampler: Sampler, slot_max_rank: list[int], block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.slot_max_rank = slot_max_rank  # shared with the adapter pages, updated on load/unload
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Run one step; returns ``(sequence, new token, logprob)`` for every sequence that samples."""
        inputs = self.prepare(batch)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.attention, inputs.segments)
        if not inputs.sampled:
            return []
        logits = self.model.compute_logits(hidden[inputs.logit_rows])
        rows = [SamplingRow(seq.params, seq.index, seq.num_output_tokens) for seq in inputs.sampled]
        token_ids, logprobs = self.sampler.sample(logits, rows)
        return list(zip(inputs.sampled, token_ids, logprobs, strict=True))

    def prepare(self, batch: SchedulerOutput) -> StepInputs:
        """Flatten the step's tokens (in scheduler order) and build the metadata every layer shares."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        write_pages: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        seg_starts: list[int] = []
        seg_lengths: list[int] = []
        seg_slots: list[int] = []
        row = 0
        for item in batch.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            write_pages += [table[p // bs] for p in range(start, end)]
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                pages = torch.tensor(table[: blocks_for(end, bs)], dtype=torch.int64)
                prefills.append(PrefillSpan(row, n, start, pages.to(self.device)))
            if item.samples:
                logit_rows.append(row + n - 1)
                sampled.append(seq)
            if seg_slots and seg_slots[-1] == seq.adapter_slot:
                seg_lengths[-1] += n
            else:
                seg_starts.append(row)
                seg_lengths.append(n)
                seg_slots.append(seq.adapter_slot)
            row += n

        device = self.device
        pos = torch.tensor(positions, dtype=torch.int64)
        attention = AttentionMetadata(
            write_pages=torch.tensor(write_pages, dtype=torch.int64).to(device),
            write_offsets=(pos % bs).to(device),
            prefills=prefills,
            decode_rows=None,
            decode_block_tables=None,
            decode_context_lens=None,
            all_decode=not prefills,
        )
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            tables = torch.zeros(len(decode_tables), width, dtype=torch.int32)
            for i, t in enumerate(decode_tables):
                tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
            attention.decode_block_tables = tables.to(device)
            attention.decode_context_lens = torch.tensor(decode_lens, dtype=torch.int32).to(device)
            if prefills:
                attention.decode_rows = torch.tensor(decode_rows, dtype=torch.int64).to(device)
        used = [s for s in seg_slots if s != NO_ADAPTER]
        segments = Segments(
            starts=torch.tensor(seg_starts, dtype=torch.int32).to(device),
            lengths=torch.tensor(seg_lengths, dtype=torch.int32).to(device),
            slots=torch.tensor(seg_slots, dtype=torch.int32).to(device),
            num_tokens=row,
            max_len=max(seg_lengths, default=0),
            max_rank=max((self.slot_max_rank[s] for s in used), default=0),
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
            positions=pos.to(device),
            attention=attention,
            segments=segments,
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64).to(device),
            sampled=sampled,
        )
