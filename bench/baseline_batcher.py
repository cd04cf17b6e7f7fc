"""The baseline's scheduler: transformers + PEFT serving queued requests one adapter batch at a time.

This is how LoRA adapters are commonly served without a multi-LoRA engine: every adapter is loaded
into one ``PeftModel``, waiting requests are grouped by adapter, and the group of the oldest request is
left-padded into one ``generate`` call (a static batch: it runs until its longest request is done,
and nothing joins it midway). A worker thread owns the model; tokens reach each request's asyncio
queue as ``generate`` streams them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

log = logging.getLogger(__name__)

FINISHED = None  # the last item on a request's token queue


@dataclass(eq=False)
class PendingRequest:
    """One queued request; the worker thread puts token ids, then ``FINISHED`` or an exception, on ``tokens``."""

    adapter: str | None  # None: the base model
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    tokens: asyncio.Queue[int | BaseException | None] = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away: stop generating for it
    emitted: int = 0  # tokens sent so far (worker thread only)
    done: bool = False  # no more tokens will be sent (worker thread only)

    def send(self, item: int | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop closed: nobody is listening
            self.loop.call_soon_threadsafe(self.tokens.put_nowait, item)


class RowStreamer(BaseStreamer):
    """Hands each generated token to its row's request until that request is done: it has its ``max_tokens``,
    or it stops at EOS (unless it asked for ``ignore_eos``: then EOS is an ordinary token, as in vLLM)."""

    def __init__(self, rows: list[PendingRequest], eos_id: int | None) -> None:
        self.rows = rows
        self.eos_id = eos_id

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:  # generate first streams the prompt itself
            return
        for row, token in zip(self.rows, value.tolist(), strict=True):
            if row.done or row.cancelled:
                continue
            if token == self.eos_id and not row.ignore_eos:
                row.done = True
                row.send(FINISHED)
                continue
            row.emitted += 1
            row.send(token)
            if row.emitted >= row.max_tokens:
                row.done = True
                row.send(FINISHED)

    def end(self) -> None:
        for row in self.rows:
            if not row.done:
                row.done = True
                row.send(FINISHED)


class RowStops(StoppingCriteria):
    """Per row: finished once it produced its own ``max_tokens``, stopped at EOS, or its client left.
    ``generate`` ends the batch when every row is finished."""

    def __init__(self, rows: list[PendingRequest], prompt_width: int, eos_id: int | None) -> None:
        self.limits = torch.tensor([row.max_tokens for row in rows])
        self.stops_at_eos = torch.tensor([not row.ignore_eos for row in rows])
        self.rows = rows
        self.prompt_width = prompt_width
        self.eos_id = eos_id

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        finished = (input_ids.shape[1] - self.prompt_width) >= self.limits
        finished |= torch.tensor([row.cancelled for row in self.rows])
        if self.eos_id is not None:
            finished |= self.stops_at_eos & (input_ids[:, -1] == self.eos_id)
        return finished


class AdapterBatcher:
    """Queue plus worker thread: one ``generate`` per adapter group, oldest group first."""

    def __init__(self, model: Any, *, pad_id: int, eos_id: int | None, max_batch: int) -> None:
        self.model = model
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.max_batch = max_batch
        self._waiting: list[PendingRequest] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="baseline-batcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def submit(self, request: PendingRequest) -> None:
        with self._wake:
            self._waiting.append(request)
            self._wake.notify()

    def _next_batch(self) -> list[PendingRequest] | None:
        """The oldest waiting request's adapter group (up to ``max_batch``); None when stopping."""
        with self._wake:
            while True:
                self._waiting = [r for r in self._waiting if not r.cancelled]
                if self._stopping:
                    return None
                if self._waiting:
                    break
                self._wake.wait()
            adapter = self._waiting[0].adapter
            batch = [r for r in self._waiting if r.adapter == adapter][: self.max_batch]
            taken = set(map(id, batch))
            self._waiting = [r for r in self._waiting if id(r) not in taken]
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._generate(batch)
            except Exception as exc:  # fail this batch's requests, keep serving the others
                log.exception("generate failed for adapter %s", batch[0].adapter)
                for row in batch:
                    if not row.done:
                        row.done = True
                        row.send(exc)

    def _generate(self, batch: list[PendingRequest]) -> None:
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, request in enumerate(batch):
            ids[i, width - len(request.prompt) :] = torch.tensor(request.prompt)
            mask[i, width - len(request.prompt) :] = 1
        with torch.inference_mode(), self._adapter(batch[0].adapter):
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_tokens for r in batch),
                do_sample=False,
                pad_token_id=self.pad_id,
                eos_token_id=None,  # EOS is handled per row by RowStops: ignore_eos rows run on past it
                streamer=RowStreamer(batch, self.eos_id),
                stopping_criteria=StoppingCriteriaList([RowStops(batch, width, self.eos_id)]),
            )

    @contextlib.contextmanager
    def _adapter(self, name: str | None) -> Iterator[None]:
        """The named adapter active, or none at all for the base model."""
        if name is None:
            with self.model.disable_adapter():
                yield
        else:
            self.model.set_adapter(name)
            yield
