"""Streaming text: deltas never split a UTF-8 character and never leak a stop string."""

from __future__ import annotations

import pytest

from core.tiny_model import BYTE_OFFSET, TinyModelSpec, make_tiny_model
from server.engine.detokenizer import IncrementalDetokenizer, StopStringFilter

TEXT = "héllo € 😀 done"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("tok"), TinyModelSpec(hidden=16, layers=1, heads=1, kv_heads=1))
    return AutoTokenizer.from_pretrained(path)


def test_deltas_only_ever_hold_whole_characters(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Prompt: ").input_ids)
    deltas = [detok.add([byte + BYTE_OFFSET]) for byte in TEXT.encode("utf-8")]
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # The 4 bytes of the emoji arrive one by one: nothing is emitted until the last one.
    emoji_start = len("héllo € ".encode())
    assert deltas[emoji_start : emoji_start + 3] == ["", "", ""] and deltas[emoji_start + 3] == "😀"


def test_stop_string_is_cut_and_never_streamed():
    stops = StopStringFilter(["STOP", "##"])
    pieces = ["ab", "cS", "TO", "Pxyz"]
    emitted, stop = [], None
    for piece in pieces:
        out, stop = stops.add(piece)
        emitted.append(out)
        if stop:
            break
    assert stop == "STOP"
    assert "".join(emitted) == "abc" == stops.text
    assert all("S" not in e for e in emitted)  # the stop string's first letter was held back, then dropped


def test_text_without_stop_is_released_on_flush():
    stops = StopStringFilter(["<end>"])
    out = "".join(stops.add(piece)[0] for piece in ["hello", " <en", "d?"])
    assert out + stops.flush() == "hello <end?"
    no_stops = StopStringFilter([])
    assert no_stops.add("abc") == ("abc", None)
