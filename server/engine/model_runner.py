"""Turns a scheduled step into tensors, runs the model, and samples the sequences that need a token."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from loraplex_kernels import SegmentRuns, Segments
from server.engine.cuda_graphs import DecodeGraphs
from server.engine.outputs import TokenLogprob
from server.engine.sampler import Sampler, SamplingRow
from server.engine.scheduler import SchedulerOutput
from server.engine.sequence import Sequence
from server.engine.step_buffers import StepBuffers
from server.memory.block_manager import blocks_for
from server.model.attention import AttentionMetadata, PrefillSpan, VarlenSpans
from server.model.llama import LlamaModel
from server.parallel.followers import Followers


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
    pages it writes. A step's inputs are views of persistent buffers, valid until the next ``prepare``.

    With :attr:`graphs` (CUDA, set by the engine builder) decode steps replay captured graphs over those buffers.
    Under tensor parallelism rank 0's runner has :attr:`followers`, told every step before its forward; a
    follower's runner takes the same steps through :meth:`follow`."""

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
        self.graphs: DecodeGraphs | None = None
        self.followers: Followers | None = None

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Run one step; returns ``(sequence, new token, logprob)`` for every sequence that samples."""
        if self.followers is not None:
            self.followers.step(batch)  # they run this step's forward beside ours
        bucket = None if self.graphs is None else self.graphs.bucket_for(batch)
        inputs = self.prepare(batch, pad_to=bucket)
        # Grammar masks depend only on what the constrained rows accepted so far: fill them during the forward.
        matchers = [seq.matcher for seq in inputs.sampled if seq.matcher is not None]
        self.sampler.masks.start(matchers, self.model.config.vocab_size)
        hidden = self._forward(inputs, bucket)
        if not inputs.sampled:
            return []
        logits = self.model.compute_logits(hidden[inputs.logit_rows])
        rows = [
            SamplingRow(seq.params, seq.index, seq.num_output_tokens, seq.matcher, seq.token_counts)
            for seq in inputs.sampled
        ]
        token_ids, logprobs = self.sampler.sample(logits, rows)
        return list(zip(inputs.sampled, token_ids, logprobs, strict=True))

    @torch.inference_mode()
    def follow(self, batch: SchedulerOutput, all_logits: bool = False) -> None:
        """A tensor-parallel follower's share of a step rank 0 executes: the same forward and the same logits
        gather (its collectives meet rank 0's), nothing sampled. ``all_logits``: rank 0 gathers every row's."""
        bucket = None if self.graphs is None else self.graphs.bucket_for(batch)
        inputs = self.prepare(batch, pad_to=bucket)
        hidden = self._forward(inputs, bucket)
        if all_logits:
            self.model.compute_logits(hidden)
        elif inputs.sampled:
            self.model.compute_logits(hidden[inputs.logit_rows])

    def _forward(self, inputs: StepInputs, bucket: int | None) -> torch.Tensor:
        if bucket is None:
            return self.model.forward(inputs.input_ids, inputs.positions, inputs.attention, inputs.segments)
        return self.graphs.replay(bucket, with_lora=inputs.segments.max_rank > 0)

    def prepare(self, batch: SchedulerOutput, pad_to: int | None = None) -> StepInputs:
        """Flatten the step's tokens (in scheduler order) into the step buffers, build the metadata every layer
        shares, and prepare the model's kernels for the step's segments.

        ``pad_to``: a decode step replayed as a graph of that many rows (:meth:`DecodeGraphs.bucket_for`); the
        buffers are filled and uploaded to that many rows, with one LoRA segment per row."""
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
        if pad_to is None:
            runs_len = len(runs.slots)
            buf.segment_starts.np[:runs_len] = runs.starts
            buf.segment_lengths.np[:runs_len] = runs.lengths
            buf.segment_slots.np[:runs_len] = runs.slots
        else:  # every row decodes: the graph's padding rows and its one segment per row
            self.graphs.pad(row, pad_to, [item.seq.adapter_slot for item in scheduled])
            row = runs_len = pad_to

        attention = AttentionMetadata(
            write_pages=buf.write_pages.upload(row),
            write_offsets=buf.write_offsets.upload(row),
            prefills=[],
            decode_rows=None,
            decode_block_tables=None,
            decode_context_lens=None,
            all_decode=not prefills,
        )
        # A backend with a varlen kernel attends to every row of a step with prompt chunks in one launch.
        varlen = bool(prefills) and self.model.kernels.varlen_prefill
        if decodes and not varlen:
            index = np.array(decodes, dtype=np.int64)
            num_decodes = len(decodes)
            decode_width = max(len(scheduled[i].seq.block_table) for i in decodes)
            buf.decode_block_tables.np[:num_decodes, :decode_width] = tables[index, :decode_width]
            buf.decode_context_lens.np[:num_decodes] = first[index] + 1
            num_rows = num_decodes if pad_to is None else pad_to
            attention.decode_block_tables = buf.decode_block_tables.upload(num_rows)[:, :decode_width]
            attention.decode_context_lens = buf.decode_context_lens.upload(num_rows)
            if prefills:
                buf.decode_rows.np[:num_decodes] = first_rows[index]
                attention.decode_rows = buf.decode_rows.upload(num_decodes)
        if varlen:
            buf.varlen_starts.np[:num_seqs] = first_rows
            buf.varlen_lens.np[:num_seqs] = count
            buf.varlen_context_lens.np[:num_seqs] = first
            attention.varlen = VarlenSpans(
                query_starts=buf.varlen_starts.upload(num_seqs),
                query_lens=buf.varlen_lens.upload(num_seqs),
                context_lens=buf.varlen_context_lens.upload(num_seqs),
                block_tables=buf.block_tables.upload(num_seqs)[:, :width],
                max_query_len=max(counts),
            )
        elif prefills:
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
        if pad_to is not None:
            segments = replace(segments, num_tokens=pad_to, max_len=1)
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
