"""SSE parsing and the load generator's reading of streams, against an in-process fake server (no sockets)."""

from __future__ import annotations

import asyncio
import json

import httpx

from bench.serve_load import LoadPlan, run_load, send
from bench.serve_workload import WorkItem
from bench.sse import DONE, SseParser, chunk_token_ids, chunk_tokens, sse_lines


def events(lines: list[str]) -> list[str]:
    parser = SseParser()
    out = [data for line in lines if (data := parser.feed(line)) is not None]
    if (last := parser.close()) is not None:
        out.append(last)
    return out


def test_sse_events_end_at_blank_lines_and_skip_comments() -> None:
    lines = [": keep-alive", "", 'data: {"a": 1}', "", "event: x", "data:no-space", "data:  two", "", "data: [DONE]"]
    assert events(lines) == ['{"a": 1}', "no-space\n two", DONE]


def test_token_counts_prefer_token_ids_over_text() -> None:
    with_ids = {"choices": [{"text": "", "token_ids": [7, 8]}]}  # held-back partial character: no text yet
    assert chunk_tokens(with_ids) == 2 and chunk_token_ids(with_ids) == [7, 8]
    text_only = {"choices": [{"text": "hi"}, {"text": ""}]}
    assert chunk_tokens(text_only) == 1 and chunk_token_ids(text_only) is None
    assert chunk_tokens({"choices": [], "usage": {"completion_tokens": 3}}) == 0


def sse(*payloads: dict | str) -> bytes:
    return "".join(
        f"data: {p if isinstance(p, str) else json.dumps(p, ensure_ascii=False)}\n\n" for p in payloads
    ).encode()


def fake_server(request: httpx.Request) -> httpx.Response:
    """Streams as many token chunks as asked; model ``busy`` is refused, ``broken`` stops mid-stream."""
    body = json.loads(request.content)
    model = body["model"]
    if model == "busy":
        return httpx.Response(429, json={"error": {"message": "queue full", "code": "overloaded"}})
    # Raw U+2028 and U+0085 in the text, as vLLM sends them: line separators to str.splitlines, not to SSE.
    text = "x\u2028\x85"
    chunks: list[dict | str] = [{"choices": [{"text": text, "token_ids": [i]}]} for i in range(body["max_tokens"])]
    if model == "broken":
        return httpx.Response(200, content=sse(*chunks[:1]))
    usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}, "loraplex": {"cold_start": True}}
    return httpx.Response(200, content=sse(*chunks, usage, DONE), headers={"content-type": "text/event-stream"})


def test_stream_lines_end_only_at_cr_lf_or_crlf_even_across_chunks() -> None:
    pieces = [b"data: a\xe2\x80\xa8b\r", b"\ndata: c\x1cd\r", b"\r\n", b"\ndata: last"]  # U+2028, then FS

    async def lines() -> list[str]:
        response = httpx.Response(200, stream=httpx.ByteStream(b"".join(pieces)))
        response.stream = _Pieces(pieces)  # one network read per piece
        return [line async for line in sse_lines(response)]

    assert asyncio.run(lines()) == ["data: a\u2028b", "data: c\x1cd", "", "", "data: last"]


class _Pieces(httpx.AsyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece


async def send_one(model: str, max_tokens: int = 3):
    async with httpx.AsyncClient(transport=httpx.MockTransport(fake_server)) as client:
        return await send(client, "http://fake/v1/completions", model, WorkItem(0, 0, [5, 6], max_tokens))


def test_a_stream_is_timed_and_counted() -> None:
    r = asyncio.run(send_one("adapter-00"))
    assert r.error is None and r.output_tokens == 3 and r.token_ids == [0, 1, 2]
    assert len(r.arrivals) == 3 and r.cold_start is True and r.ttft() is not None


def test_failures_are_recorded_by_kind() -> None:
    assert asyncio.run(send_one("busy")).error == "http 429 overloaded"
    assert asyncio.run(send_one("broken")).error == "stream ended without [DONE]"


def test_run_load_sends_exactly_the_planned_requests(monkeypatch) -> None:
    real_client = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(fake_server), **kw)
    )
    items = iter([WorkItem(i, i % 2, [5], 2) for i in range(10)])
    records, wall = asyncio.run(run_load("http://fake", ["a", "b"], items, LoadPlan(clients=3, requests=7)))
    assert sorted(r.index for r in records) == list(range(7))
    assert all(r.error is None and r.output_tokens == 2 for r in records) and wall > 0
