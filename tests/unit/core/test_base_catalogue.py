"""The base-model catalogue: LORAPLEX_BASE_MODEL first, then LORAPLEX_BASE_MODELS, names unique."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.base_catalogue import BaseEntry, base_catalogue, parse_base_models
from core.errors import ConfigError
from core.settings import load_settings


def test_entries_are_named_or_take_the_sources_default_name() -> None:
    assert parse_base_models(" qwen=/models/qwen2 , meta-llama/Llama-3.2-1B@main,,/srv/models/mistral-7b ") == [
        BaseEntry("qwen", "/models/qwen2"),
        BaseEntry("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B@main"),
        BaseEntry("mistral-7b", "/srv/models/mistral-7b"),
    ]


@pytest.mark.parametrize("text", ["=/models/x", "name=", " = "])
def test_a_malformed_entry_is_named(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_base_models(text)
    assert "LORAPLEX_BASE_MODELS" in caught.value.message and repr(text.strip()) in caught.value.message


def test_the_default_base_comes_first_and_names_must_differ(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, base_model="/models/tiny-llama", base_models="q=/models/tiny-qwen")
    assert base_catalogue(settings) == [
        BaseEntry("tiny-llama", "/models/tiny-llama"),
        BaseEntry("q", "/models/tiny-qwen"),
    ]

    clash = load_settings(data_dir=tmp_path, base_model="/models/tiny-llama", base_models="/elsewhere/tiny-llama")
    with pytest.raises(ConfigError) as caught:
        base_catalogue(clash)
    assert "two base models are named 'tiny-llama'" in caught.value.message

    with pytest.raises(ConfigError):
        base_catalogue(load_settings(data_dir=tmp_path, base_models="q=/models/tiny-qwen"))  # no default base
