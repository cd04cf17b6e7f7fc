"""Job requests checked before anything is stored: model, suffix, hyperparameters (the field is named)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from api.job_submission import check_base_model, resolve_hyperparameters
from api.routers.fine_tuning_schemas import JobCreate
from core.errors import InvalidRequest
from core.settings import load_settings

SETTINGS = load_settings(data_dir=Path("/nonexistent"), max_lora_rank=32)


def request(**fields: object) -> JobCreate:
    return JobCreate.model_validate({"model": "base", "training_file": "file-1", **fields})


def test_defaults_resolve_to_concrete_values() -> None:
    resolved = resolve_hyperparameters(request(), SETTINGS, context_length=2048)

    assert (resolved.n_epochs, resolved.lora_r, resolved.lora_alpha) == (3, 8, 16.0)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"hyperparameters": {"lora_r": 64}}, "hyperparameters.lora_r"),
        ({"hyperparameters": {"max_seq_len": 4096}}, "hyperparameters.max_seq_len"),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"lora_r": 0}}}},
            "method.supervised.hyperparameters.lora_r",
        ),
    ],
)
def test_out_of_range_values_name_their_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        resolve_hyperparameters(request(**fields), SETTINGS, context_length=2048)

    assert caught.value.param == param


def test_hyperparameters_in_two_places_are_refused() -> None:
    both = request(
        hyperparameters={"n_epochs": 1},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
    )

    with pytest.raises(InvalidRequest) as caught:
        resolve_hyperparameters(both, SETTINGS, context_length=None)
    assert caught.value.param == "method"


@pytest.mark.parametrize("suffix", ["ok", "My_Model-2", "x" * 64])
def test_safe_suffixes_pass(suffix: str) -> None:
    assert request(suffix=suffix).suffix == suffix


@pytest.mark.parametrize("suffix", ["", "has:colon", "-leading", "sp ace", "x" * 65, "slash/y", "é"])
def test_unsafe_suffixes_are_refused(suffix: str) -> None:
    with pytest.raises(ValidationError):
        request(suffix=suffix)


def test_only_the_base_model_can_be_fine_tuned() -> None:
    check_base_model("base", "base")
    for other in ("gpt-4o-mini", "ft:base:acme::ftjob-1"):
        with pytest.raises(InvalidRequest) as caught:
            check_base_model(other, "base")
        assert caught.value.param == "model" and "'base'" in caught.value.message
