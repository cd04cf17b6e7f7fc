"""Job requests checked before anything is stored: model (the base, or a fine-tuned model of the tenant's to
continue), method, suffix, hyperparameters (the field is named)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from api.base_model import load_base_models
from api.job_submission import resolve_hyperparameters, resolve_model
from api.ownership import ServedModel
from api.routers.fine_tuning_schemas import JobCreate
from core import db
from core.accounts import create_tenant
from core.errors import InvalidRequest
from core.models import Adapter
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


def parent_adapter(tenant_id: str = "tenant-1", **fields: object) -> Adapter:
    values = {
        "id": "adapter-1",
        "tenant_id": tenant_id,
        "name": "ft:base:acme:first:ftjob-1",
        "base_model": "base",
        "storage_prefix": "tenants/tenant-1/adapters/adapter-1/",
        "sha256": "0" * 64,
        "config_sha256": "0" * 64,
        "rank": 16,
        "alpha": 8.0,
        "target_modules": ["q_proj", "v_proj"],
        **fields,
    }
    return Adapter(**values)


def test_a_served_base_or_a_fine_tuned_model_of_ones_own_on_one_can_be_fine_tuned(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    bases = load_base_models(
        load_settings(
            data_dir=tmp_path, base_model=tiny_model_dir, base_model_name="base", base_models=f"second={tiny_model_dir}"
        )
    )
    url = f"sqlite:///{tmp_path / 'loraplex.db'}"
    db.upgrade(url)
    with db.session_scope(db.make_engine(url)) as session:
        acme, _ = create_tenant(session, "acme")
        other, _ = create_tenant(session, "other")
        session.add(parent_adapter(acme.id))
        session.add(parent_adapter(other.id, id="adapter-2", name="ft:base:other:theirs:ftjob-2"))
        session.add(parent_adapter(acme.id, id="adapter-3", name="ft:old:acme:x:ftjob-3", base_model="old"))
        session.add(parent_adapter(acme.id, id="adapter-4", name="ft:second:acme:x:ftjob-4", base_model="second"))
        session.flush()

        assert resolve_model(session, acme, "base", bases) == ServedModel(bases.default, None)
        assert resolve_model(session, acme, "second", bases) == ServedModel(bases.get("second"), None)  # type: ignore[arg-type]
        target = resolve_model(session, acme, "ft:base:acme:first:ftjob-1", bases)
        assert (target.base.name, target.adapter.id if target.adapter else None) == ("base", "adapter-1")
        target = resolve_model(session, acme, "ft:second:acme:x:ftjob-4", bases)
        assert (target.base.name, target.adapter.id if target.adapter else None) == ("second", "adapter-4")
        # Someone else's model, one on another base, and made-up names read alike.
        messages = set()
        for name in ("gpt-4o-mini", "ft:base:other:theirs:ftjob-2", "ft:old:acme:x:ftjob-3", "ft:base:acme::nope"):
            with pytest.raises(InvalidRequest) as caught:
                resolve_model(session, acme, name, bases)
            assert caught.value.param == "model" and caught.value.code == "model_not_available"
            assert "'base', 'second'" in caught.value.message
            messages.add(caught.value.message.replace(repr(name), "NAME"))
        assert len(messages) == 2  # one for a name that is no fine-tuned model, one for every ft: name alike


def test_a_continued_model_keeps_its_adapter_shape_and_refuses_another() -> None:
    parent = parent_adapter()
    resolved = resolve_hyperparameters(request(hyperparameters={"n_epochs": 1}), SETTINGS, None, parent=parent)
    assert (resolved.lora_r, resolved.lora_alpha, resolved.target_modules) == (16, 8.0, ["q_proj", "v_proj"])
    assert resolve_hyperparameters(request(hyperparameters={"lora_r": 16}), SETTINGS, None, parent=parent).lora_r == 16

    with pytest.raises(InvalidRequest) as caught:
        resolve_hyperparameters(request(hyperparameters={"lora_r": 8}), SETTINGS, None, parent=parent)
    assert caught.value.param == "hyperparameters.lora_r" and "16" in caught.value.message


def test_dpo_takes_beta_and_supervised_refuses_it() -> None:
    dpo = request(method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.5, "n_epochs": 2}}})
    assert resolve_hyperparameters(dpo, SETTINGS, None).beta == 0.5
    assert resolve_hyperparameters(request(method={"type": "dpo"}), SETTINGS, None).beta == 0.1  # auto
    assert resolve_hyperparameters(request(), SETTINGS, None).beta is None

    with pytest.raises(InvalidRequest) as caught:
        resolve_hyperparameters(request(hyperparameters={"beta": 0.5}), SETTINGS, None)
    assert caught.value.param == "hyperparameters.beta" and "dpo" in caught.value.message


@pytest.mark.parametrize(
    "method",
    [
        {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}},
        {"type": "dpo", "dpo": {"hyperparameters": {"beta": 2.5}}},
        {"type": "supervised", "dpo": {"hyperparameters": {"beta": 0.1}}},
        {"type": "dpo", "supervised": {}},
        {"type": "reinforcement"},
    ],
)
def test_a_method_that_does_not_add_up_is_refused(method: dict) -> None:
    with pytest.raises(ValidationError):
        request(method=method)
