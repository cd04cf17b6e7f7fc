"""What the client sees of a replica's stream, and what the request is metered at."""

from __future__ import annotations

from api.inference.metering import InferenceMeter, Outcome
from api.inference.relay import broken_stream_events, client_event
from api.inference.requests import UsageShown
from api.inference.sse import EventSplitter, encode_event, parse_event
from core.models import Tenant
from core.protocol import STATS_FIELD

STATS = {"replica": "r1", "cold_start": True, "adapter_load_ms": 12.0, "queue_ms": 1.0, "gpu_seconds": 0.25}


def text(piece: str, so_far: int | None = None) -> dict:
    """A content chunk; with ``so_far``, as the API asks replicas for it: the usage up to this chunk."""
    chunk: dict = {"id": "c", "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
    if so_far is not None:
        chunk["usage"] = {"prompt_tokens": 7, "completion_tokens": so_far}
    return chunk


def usage_chunk() -> dict:
    return {"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}, STATS_FIELD: STATS}


def meter() -> InferenceMeter:
    return InferenceMeter(
        tenant=Tenant(id="tenant-1", name="acme"), model="ft:x", adapter_id="adapter-1", request_id="r"
    )


def relay(events: list[dict], shown: UsageShown) -> tuple[list[dict], InferenceMeter]:
    m = meter()
    out = [client_event(parse_event(encode_event(e)), m, shown) for e in events]
    return [parse_event(o).body for o in out if o is not None], m


def test_a_client_that_asked_for_usage_gets_the_usage_chunk_without_the_stats() -> None:
    seen, m = relay([text("a", 1), text("b", 2), usage_chunk()], UsageShown.FINAL)
    assert seen[:2] == [{**text("a"), "usage": None}, {**text("b"), "usage": None}]  # OpenAI's shape
    assert seen[-1] == {"id": "c", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
    assert all(STATS_FIELD not in body for body in seen)
    record = m.record()
    assert (record.prompt_tokens, record.completion_tokens, record.cold_start) == (7, 2, True)
    assert (record.replica, record.gpu_seconds, record.status) == ("r1", 0.25, Outcome.COMPLETED)
    assert record.ttft_ms is not None and record.latency_ms is not None


def test_a_client_that_did_not_ask_gets_no_usage_chunk_but_the_request_is_still_metered() -> None:
    seen, m = relay([text("a", 1), {**text("b"), "usage": None}, usage_chunk()], UsageShown.NONE)
    assert seen == [text("a"), text("b")]  # no usage field at all, as OpenAI sends when not asked
    assert m.tokens() == (7, 2)


def test_a_client_that_asked_for_continuous_usage_gets_it_on_every_chunk() -> None:
    seen, m = relay([text("a", 1), text("b", 2), usage_chunk()], UsageShown.EVERY_CHUNK)
    assert [body["usage"]["completion_tokens"] for body in seen] == [1, 2, 2]
    assert m.tokens() == (7, 2)


def test_cached_prompt_tokens_are_recorded_and_charged_only_when_asked() -> None:
    m = meter()
    m.usage = {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}
    assert (m.record().prompt_tokens, m.record().cached_tokens) == (40, 32)
    assert (m.limited_tokens(charge_cached=True), m.limited_tokens(charge_cached=False)) == (43, 11)
    m.usage = {"prompt_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 99}}
    assert m.cached_tokens() == 4  # never more than the prompt
    m.usage = {"prompt_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": None}
    assert m.record().cached_tokens == 0


def test_usage_riding_on_a_text_chunk_is_removed_not_the_text() -> None:
    chunk = {**text("z"), "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    seen, _ = relay([chunk], UsageShown.NONE)
    assert seen == [text("z")]


def test_unchanged_chunks_pass_byte_for_byte() -> None:
    raw = b'data: {"id":"c",  "choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    assert client_event(parse_event(raw), meter(), UsageShown.NONE) == raw


def test_a_stream_cut_short_is_metered_at_what_was_delivered_prompt_included() -> None:
    _, m = relay([text("a", 1), text("b", 2), text("c", 3)], UsageShown.NONE)
    m.status = Outcome.CLIENT_DISCONNECTED
    record = m.record()
    assert (record.prompt_tokens, record.completion_tokens, record.status) == (7, 3, "client_disconnected")


def test_a_request_that_ends_before_any_output_is_billed_nothing() -> None:
    _, m = relay(
        [{"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}], "usage": None}], UsageShown.NONE
    )
    assert m.tokens() == (0, 0) and m.record().ttft_ms is None


def test_a_broken_stream_ends_with_an_openai_error_then_done() -> None:
    events = [parse_event(e) for e in EventSplitter().feed(broken_stream_events("replica died"))]
    assert events[0].error == {
        "message": "replica died",
        "type": "server_error",
        "param": None,
        "code": "upstream_failed",
    }
    assert events[1].done
