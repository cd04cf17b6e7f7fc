"""Decode steps replayed from CUDA graphs captured at start, one per batch-size bucket, as vLLM and SGLang do.

A decode step of a small model is hundreds of small kernels; launched one by one from Python they cost more than
they compute. A graph launches them all at once. Graphs need fixed shapes and fixed addresses, so:

* a step of ``n`` decoding sequences runs the graph of the smallest bucket ``b >= n``; rows ``n .. b`` are padding:
  token 0 at position 0 writing its K/V into a scratch page the graphs hold, attending to that page alone, with no
  adapter. Their hidden states are computed and never read;
* every input is a view of the runner's persistent step buffers (:mod:`server.engine.step_buffers`), which a step
  refills in place; block tables are read at a fixed width (:data:`MAX_GRAPH_CONTEXT` tokens, or the model's
  length if shorter), so the attention kernel's grid never changes: a longer sequence makes its step run eagerly;
* LoRA segments are one per row (the grid of ``b`` segments of one token is fixed, while merged runs are not), and
  the graph with LoRA is captured at the engine's largest rank: kernels read each segment's own rank at run time.
  A second set, captured without LoRA, serves steps in which no row uses an adapter.

Steps with prompt tokens, and decode steps above the largest bucket, run eagerly. Graphs need the Triton kernels
(the torch backend reads segments on the host). On CPU nothing is captured; tests run the same padded steps
eagerly with ``capture=False``, which checks everything but the capture itself.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from dataclasses import dataclass

import numpy as np
import torch

from loraplex_kernels import NO_ADAPTER, Segments
from server.engine.scheduler import SchedulerOutput
from server.engine.step_buffers import StepBuffers
from server.memory.pool import PagePool, PageUse
from server.model.attention import AttentionMetadata
from server.model.llama import LlamaModel

log = logging.getLogger(__name__)

# Largest decode batch captured by default: past it the launch overhead is small beside the step's own work.
MAX_GRAPH_BATCH = 256
# Longest context a graph's attention covers (vLLM's default too): every replay's grid spans it, so a longer one
# would make short contexts pay for programs that exit at once.
MAX_GRAPH_CONTEXT = 8192


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to ``max_batch`` (always included)."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    sizes = {size for size in (1, 2, 4) if size <= max_batch}
    sizes.update(range(8, max_batch + 1, 8))
    sizes.add(max_batch)
    return tuple(sorted(sizes))


@dataclass
class CapturedStep:
    """One bucket's forward: its fixed inputs and, on CUDA, the graph and the hidden states it writes."""

    batch: int
    segments: Segments
    attention: AttentionMetadata
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None


class DecodeGraphs:
    """Decode steps of up to :attr:`largest` sequences, replayed from graphs over the runner's step buffers.

    Holds one KV page of the pool (the padding rows' scratch page) for as long as the engine lives."""

    def __init__(
        self,
        model: LlamaModel,
        buffers: StepBuffers,
        pool: PagePool,
        buckets: tuple[int, ...],
        lora_rank: int,
        max_blocks: int,
        *,
        capture: bool = True,
    ) -> None:
        if not buckets or buckets[-1] > min(buffers.max_seqs, buffers.max_tokens):
            raise ValueError(f"graph buckets {buckets} must fit the step buffers ({buffers.max_seqs} sequences)")
        if not 1 <= max_blocks <= buffers.max_blocks:
            raise ValueError(f"graphs read 1..{buffers.max_blocks} blocks per sequence, not {max_blocks}")
        self.model = model
        self.buffers = buffers
        self.buckets = buckets
        self.lora_rank = lora_rank
        self.max_blocks = max_blocks  # block-table width every graph reads
        self.capture = capture
        self.scratch_page = pool.allocate(1, PageUse.KV)[0]
        self._steps: dict[tuple[int, bool], CapturedStep] = {}
        self._pool_handle = None  # one memory pool shared by every graph (captured largest first)

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    @property
    def num_graphs(self) -> int:
        return len(self._steps)

    def bucket_for(self, batch: SchedulerOutput) -> int | None:
        """The bucket this step replays, or None when it runs eagerly (prompt tokens, or too many sequences)."""
        num_seqs = len(batch.scheduled)
        if num_seqs == 0 or num_seqs > self.largest or batch.num_tokens != num_seqs:
            return None
        if max(len(item.seq.block_table) for item in batch.scheduled) > self.max_blocks:
            return None
        return self.buckets[bisect_left(self.buckets, num_seqs)]

    def pad(self, num_seqs: int, bucket: int, slots: list[int]) -> None:
        """Fill the host side of the step buffers for a decode step of ``num_seqs`` rows run as ``bucket``.

        The caller has filled rows ``< num_seqs`` of the token and decode buffers; this fills the padding rows and
        lays out one LoRA segment per row (``slots``: the sequences' adapter slots, in row order)."""
        buf, pad = self.buffers, slice(num_seqs, bucket)
        buf.input_ids.np[pad] = 0
        buf.positions.np[pad] = 0
        buf.write_pages.np[pad] = self.scratch_page
        buf.write_offsets.np[pad] = 0
        buf.logit_rows.np[pad] = 0
        buf.decode_block_tables.np[pad, 0] = self.scratch_page
        buf.decode_context_lens.np[pad] = 1
        buf.segment_starts.np[:bucket] = np.arange(bucket)
        buf.segment_lengths.np[:bucket] = 1
        buf.segment_slots.np[:num_seqs] = slots
        buf.segment_slots.np[pad] = NO_ADAPTER

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture (or, without CUDA, prepare) every bucket with and without LoRA; returns the seconds it took."""
        started = time.perf_counter()
        variants = (True, False) if self.lora_rank > 0 else (False,)
        for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
            self._upload_padding(bucket)
            for with_lora in variants:
                self._steps[(bucket, with_lora)] = self._capture(bucket, with_lora)
        if self.capture:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def replay(self, bucket: int, with_lora: bool) -> torch.Tensor:
        """Hidden states ``[bucket, hidden]`` of a step whose inputs :meth:`pad` and the uploads put in place."""
        step = self._steps[(bucket, with_lora and self.lora_rank > 0)]
        if step.graph is None:
            return self._forward(step)
        step.graph.replay()
        return step.hidden

    def _capture(self, bucket: int, with_lora: bool) -> CapturedStep:
        buf = self.buffers
        segments = Segments(
            starts=buf.segment_starts.device_tensor[:bucket],
            lengths=buf.segment_lengths.device_tensor[:bucket],
            slots=buf.segment_slots.device_tensor[:bucket],
            num_tokens=bucket,
            max_len=1,
            max_rank=self.lora_rank if with_lora else 0,
        )
        attention = AttentionMetadata(
            write_pages=buf.write_pages.device_tensor[:bucket],
            write_offsets=buf.write_offsets.device_tensor[:bucket],
            prefills=[],
            decode_rows=None,
            decode_block_tables=buf.decode_block_tables.device_tensor[:bucket, : self.max_blocks],  # a fixed grid
            decode_context_lens=buf.decode_context_lens.device_tensor[:bucket],
            all_decode=True,
        )
        step = CapturedStep(bucket, segments, attention)
        if not self.capture:
            return step
        # Warm up off the capture (Triton compiles and picks configs here), then record the same forward.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(step)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool_handle is None:
            self._pool_handle = torch.cuda.graph_pool_handle()
        step.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.graph, pool=self._pool_handle):
            step.hidden = self._forward(step)
        return step

    def _forward(self, step: CapturedStep) -> torch.Tensor:
        buf = self.buffers
        self.model.kernels.prepare(step.segments)
        return self.model.forward(
            buf.input_ids.device_tensor[: step.batch],
            buf.positions.device_tensor[: step.batch],
            step.attention,
            step.segments,
        )

    def _upload_padding(self, bucket: int) -> None:
        """Make every row of ``bucket`` a padding row on the device, so a capture's warm-up reads valid pages."""
        buf = self.buffers
        buf.wait_for_copies()
        self.pad(0, bucket, [])
        for staged in (
            buf.input_ids,
            buf.positions,
            buf.write_pages,
            buf.write_offsets,
            buf.decode_block_tables,
            buf.decode_context_lens,
            buf.segment_starts,
            buf.segment_lengths,
            buf.segment_slots,
        ):
            staged.upload(bucket)
        buf.copies_issued()


def capture_decode_graphs(
    model: LlamaModel, buffers: StepBuffers, pool: PagePool, max_batch: int, lora_rank: int, max_blocks: int
) -> DecodeGraphs:
    """Capture the decode graphs of an engine on CUDA, logging how many and how long it took."""
    graphs = DecodeGraphs(model, buffers, pool, graph_buckets(max_batch), lora_rank, max_blocks)
    seconds = graphs.capture_all()
    log.info(
        "captured %d decode CUDA graphs (batch %d..%d%s) in %.1f s",
        graphs.num_graphs,
        graphs.buckets[0],
        graphs.largest,
        ", with and without LoRA" if lora_rank > 0 else "",
        seconds,
    )
    return graphs
