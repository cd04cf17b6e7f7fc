"""Turns a scheduled step into tensors, runs the model, and samples the sequences that need a token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex_kernels import SegmentRuns, Segments
from server.engine.outputs import TokenLogprob
from server.engine.sampler import Sampler, SamplingRow
from server.engine.scheduler import SchedulerOutput
from server.engine.sequence import Sequence
from server.engine.step_buffers import StepBuffers
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
    """Owns the model on its device and the step's input buffers; stateless between steps apart from the KV
    pages it writes. A step's inputs are views of persistent buffers, valid until the next ``prepare``."""

    def __init__(
        self,
        model: LlamaModel,
        sampler: Sampler,
        slot_max_rank: list[int],
        block_size: int,
        device: torch.device,
        buffers: StepBuffers,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.slot_max_rank = slot_max_rank  # shared with the adapter pages, updated on load/unload
        self.block_size = block_size
        self.device = device
        self.buffers = buffers

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Run one step; returns ``(sequence, new token, logprob)`` for every sequence that samples."""
        inputs = self.prepare(batch)
        # Grammar masks depend only on what the constrained rows accepted so far: fill them during the forward.
        matchers = [seq.matcher for seq in inputs.sampled if seq.matcher is not None]
        self.sampler.masks.start(matchers, self.model.config.vocab_size)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.attention, inputs.segments)
        if not inputs.sampled:
            return []
        logits = self.model.compute_logits(hidden[inputs.logit_rows])
        rows = [
            SamplingRow(seq.params, seq.index, seq.num_output_tokens, seq.matcher, seq.token_counts)
            for seq in inputs.sampled
        ]
        token_ids, logprobs = self.sampler.sample(logits, rows)
        return list(zip(inputs.sampled, token_ids, logprobs, strict=True))

    def prepare(self, batch: SchedulerOutput) -> StepInputs:
        """Flatten the step's tokens (in scheduler order) into the step buffers, build the metadata every layer
        shares, and prepare the model's kernels for the step's segments."""
        buf, bs, scheduled = self.buffers, self.block_size, batch.scheduled
        num_seqs = len(scheduled)
        width = max((len(item.seq.block_table) for item in scheduled), default=0)
        if num_seqs > buf.max_seqs or batch.num_tokens > buf.max_tokens or width > buf.max_blocks:
            raise ValueError(
                f"a step of {num_seqs} sequences, {batch.num_tokens} tokens and {width} blocks per sequence "
                f"exceeds the step buffers ({buf.max_seqs}, {buf.max_tokens}, {buf.max_blocks})"
            )
        buf.wait_for_copies()
        tables = buf.block_tables.np
        tables[:num_seqs, :width] = 0
        input_ids: list[int] = []
        firsts: list[int] = []  # per sequence: position of its first new token
        counts: list[int] = []  # per sequence: new tokens
        decodes: list[int] = []  # indices of single-token sequences
        prefills: list[tuple[int, int, int, int]] = []  # (sequence index, row, tokens, context)
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        runs = SegmentRuns()
        row = 0
        for i, item in enumerate(scheduled):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            table = seq.block_table
            tables[i, : len(table)] = table
            input_ids += seq.token_ids[start : start + n]
            firsts.append(start)
            counts.append(n)
            if n == 1:
                decodes.append(i)
            else:
                prefills.append((i, row, n, start))
            if item.samples:
                logit_rows.append(row + n - 1)
                sampled.append(seq)
            runs.add(seq.adapter_slot, n)
            row += n

        # Per-token positions and write slots, vectorised over the step.
        count = np.array(counts, dtype=np.int64)
        first_rows = np.cumsum(count) - count
        first = np.array(firsts, dtype=np.int64)
        positions = np.arange(row, dtype=np.int64) + np.repeat(first - first_rows, count)
        buf.input_ids.np[:row] = input_ids
        buf.positions.np[:row] = positions
        buf.write_offsets.np[:row] = positions % bs
        buf.write_pages.np[:row] = tables[np.repeat(np.arange(num_seqs), count), positions // bs]
        buf.logit_rows.np[: len(logit_rows)] = logit_rows
        runs_len = len(runs.slots)
        buf.segment_starts.np[:runs_len] = runs.starts
        buf.segment_lengths.np[:runs_len] = runs.lengths
        buf.segment_slots.np[:runs_len] = runs.slots

        attention = AttentionMetadata(
            write_pages=buf.write_pages.upload(row),
            write_offsets=buf.write_offsets.upload(row),
            prefills=[],
            decode_rows=None,
            decode_block_tables=None,
            decode_context_lens=None,
            all_decode=not prefills,
        )
        if decodes:
            index = np.array(decodes, dtype=np.int64)
            num_decodes = len(decodes)
            decode_width = max(len(scheduled[i].seq.block_table) for i in decodes)
            buf.decode_block_tables.np[:num_decodes, :decode_width] = tables[index, :decode_width]
            buf.decode_context_lens.np[:num_decodes] = first[index] + 1
            attention.decode_block_tables = buf.decode_block_tables.upload(num_decodes)[:, :decode_width]
            attention.decode_context_lens = buf.decode_context_lens.upload(num_decodes)
            if prefills:
                buf.decode_rows.np[:num_decodes] = first_rows[index]
                attention.decode_rows = buf.decode_rows.upload(num_decodes)
        if prefills:
            block_tables = buf.block_tables.upload(num_seqs)
            attention.prefills = [
                PrefillSpan(at, n, context, block_tables[i, : blocks_for(context + n, bs)])
                for i, at, n, context in prefills
            ]
        segments = runs.segments(
            buf.segment_starts.upload(runs_len),
            buf.segment_lengths.upload(runs_len),
            buf.segment_slots.upload(runs_len),
            self.slot_max_rank,
        )
        inputs = StepInputs(
            input_ids=buf.input_ids.upload(row),
            positions=buf.positions.upload(row),
            attention=attention,
            segments=segments,
            logit_rows=buf.logit_rows.upload(len(logit_rows)),
            sampled=sampled,
        )
        buf.copies_issued()
        self.model.kernels.prepare(segments)
        return inputs
