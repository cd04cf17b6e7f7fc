"""The baseline's per-row bookkeeping: each request gets exactly its own tokens out of a shared static batch."""

from __future__ import annotations

import asyncio

import torch

from bench.baseline_batcher import FINISHED, PendingRequest, RowStops, RowStreamer

EOS = 2


async def drain(request: PendingRequest) -> list[int | None]:
    await asyncio.sleep(0)  # let call_soon_threadsafe deliveries run
    items = []
    while not request.tokens.empty():
        items.append(request.tokens.get_nowait())
    return items


def rows(*specs: tuple[int, bool]) -> list[PendingRequest]:
    loop = asyncio.get_running_loop()
    return [PendingRequest(None, [5, 6], max_tokens, ignore_eos, loop) for max_tokens, ignore_eos in specs]


def test_rows_stop_at_their_own_length_or_at_eos() -> None:
    async def scenario() -> list[list[int | None]]:
        batch = rows((2, False), (4, False), (4, True))
        streamer = RowStreamer(batch, EOS)
        streamer.put(torch.tensor([[5, 6]] * 3))  # the prompt: not output
        for step in ([7, 7, 7], [8, EOS, EOS], [9, 9, 9], [9, 9, 9]):
            streamer.put(torch.tensor(step))
        streamer.end()
        return [await drain(r) for r in batch]

    short, stopped, ignoring = asyncio.run(scenario())
    assert short == [7, 8, FINISHED]
    assert stopped == [7, FINISHED]  # EOS ends it and is not sent as text
    assert ignoring == [7, EOS, 9, 9, FINISHED]  # ignore_eos: EOS is an ordinary token, length is exact


def test_stopping_criteria_mark_rows_finished_so_the_batch_can_end() -> None:
    async def scenario() -> list[list[bool]]:
        batch = rows((1, False), (3, False), (3, True))
        stops = RowStops(batch, prompt_width=2, eos_id=EOS)
        first = stops(torch.tensor([[5, 6, 7], [5, 6, EOS], [5, 6, EOS]]), None).tolist()
        batch[2].cancelled = True
        second = stops(torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8], [5, 6, 7, 8]]), None).tolist()
        return [first, second]

    first, second = asyncio.run(scenario())
    assert first == [True, True, False]  # row 0 reached max_tokens=1; row 1 hit EOS; row 2 ignores EOS
    assert second == [True, False, True]  # row 2's client went away
