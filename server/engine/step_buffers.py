"""Persistent per-step input buffers, filled in place on the host and copied to the device without blocking.

Sized once from the engine's limits (tokens and sequences per step, blocks per sequence), so every step's model
inputs are views of the same storage, as CUDA graphs and tensor parallelism need. On CUDA each buffer has a
pinned host twin and a step copies only the prefix it filled; on CPU host and device are one tensor.
"""

from __future__ import annotations

import numpy as np
import torch


class StagedBuffer:
    """A device tensor and the host tensor it is filled from (the same tensor on CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.device_tensor = torch.zeros(shape, dtype=dtype, device=device)
        on_host = device.type == "cpu"
        self.host = self.device_tensor if on_host else torch.zeros(shape, dtype=dtype, pin_memory=True)
        self.np: np.ndarray = self.host.numpy()  # numpy fills from Python lists several times faster than torch

    def upload(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows on the device, copied from the host without blocking when they differ."""
        if self.host is not self.device_tensor:
            self.device_tensor[:rows].copy_(self.host[:rows], non_blocking=True)
        return self.device_tensor[:rows]


class StepBuffers:
    """Every tensor a step's metadata needs, each with room for the largest step the engine schedules."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        i64, i32 = torch.int64, torch.int32
        self.input_ids = StagedBuffer((max_tokens,), i64, device)
        self.positions = StagedBuffer((max_tokens,), i64, device)
        self.write_pages = StagedBuffer((max_tokens,), i64, device)
        self.write_offsets = StagedBuffer((max_tokens,), i64, device)
        self.logit_rows = StagedBuffer((max_seqs,), i64, device)
        self.decode_rows = StagedBuffer((max_seqs,), i64, device)
        self.decode_context_lens = StagedBuffer((max_seqs,), i32, device)
        self.decode_block_tables = StagedBuffer((max_seqs, max_blocks), i32, device)
        self.block_tables = StagedBuffer((max_seqs, max_blocks), i32, device)  # every scheduled sequence
        # One varlen attention launch for a step with prompt chunks: each sequence's first row, rows, cached tokens.
        self.varlen_starts = StagedBuffer((max_seqs,), i32, device)
        self.varlen_lens = StagedBuffer((max_seqs,), i32, device)
        self.varlen_context_lens = StagedBuffer((max_seqs,), i32, device)
        self.segment_starts = StagedBuffer((max_seqs,), i32, device)
        self.segment_lengths = StagedBuffer((max_seqs,), i32, device)
        self.segment_slots = StagedBuffer((max_seqs,), i32, device)
        # Host buffers are refilled next step: the copies reading them must have finished by then.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def wait_for_copies(self) -> None:
        """Block until the last step's host-to-device copies are done, so the host side may be refilled."""
        if self._copied is not None:
            self._copied.synchronize()

    def copies_issued(self) -> None:
        """Mark the end of this step's copies on the current stream."""
        if self._copied is not None:
            self._copied.record()
