"""Splitting replica streams into events however the bytes arrive, and reading what metering needs."""

from __future__ import annotations

import json

import pytest

from api.inference.sse import EventSplitter, encode_event, parse_event

CHUNK = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
ROLE = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
STREAM = encode_event(ROLE) + encode_event(CHUNK) + encode_event(USAGE) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("size", [1, 2, 7, 64, len(STREAM)])
def test_events_come_out_whole_whatever_the_transport_chunking(size: int) -> None:
    splitter = EventSplitter()
    events = [e for i in range(0, len(STREAM), size) for e in splitter.feed(STREAM[i : i + size])]
    assert b"".join(events) == STREAM
    assert [parse_event(e).body for e in events] == [ROLE, CHUNK, USAGE, None]
    assert parse_event(events[-1]).done
    assert splitter.rest() == b""


def test_crlf_separated_events_are_split_too() -> None:
    raw = b"data: " + json.dumps(CHUNK).encode() + b"\r\n\r\ndata: [DONE]\r\n\r\n"
    events = list(EventSplitter().feed(raw))
    assert len(events) == 2 and parse_event(events[1]).done


def test_a_half_event_waits_for_its_end() -> None:
    splitter = EventSplitter()
    assert list(splitter.feed(b'data: {"a"')) == []
    assert splitter.rest() == b'data: {"a"'


def test_role_only_chunks_do_not_commit_a_stream_but_text_usage_and_errors_do() -> None:
    assert not parse_event(encode_event(ROLE)).carries_output()
    assert parse_event(encode_event(CHUNK)).carries_output()
    assert parse_event(encode_event(USAGE)).carries_output()
    assert parse_event(encode_event({"error": {"message": "x"}})).carries_output()
    assert parse_event(b"data: [DONE]\n\n").carries_output()
    assert not parse_event(b": keep-alive\n\n").carries_output()


def test_pieces_count_text_carrying_choices_of_chat_and_completion_chunks() -> None:
    two_choices = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}, {"index": 2, "text": ""}]}
    assert parse_event(encode_event(two_choices)).pieces() == 2
    assert parse_event(encode_event(CHUNK)).pieces() == 1
    assert parse_event(encode_event(USAGE)).pieces() == 0


def test_non_json_data_is_kept_raw() -> None:
    chunk = parse_event(b"data: not json\n\n")
    assert chunk.body is None and chunk.raw == b"data: not json\n\n"
