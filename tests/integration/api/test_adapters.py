"""Bring-your-own adapters: a PEFT-made adapter uploads and is listed as a model; mismatched ones are refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import openai
import pytest
from sqlmodel import Session

from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from core.base_fingerprint import read_adapter_origin
from core.db import make_engine
from core.models import Adapter
from core.settings import Settings
from core.storage import open_store
from tests.integration.api.conftest import TEST_MAX_LORA_RANK, PeftAdapters, TenantHandle
from tests.integration.api.peft_adapters import adapter_files, pickle_payload, with_config


def test_a_peft_adapter_uploads_and_appears_in_models(
    tenant: TenantHandle, peft_adapters: PeftAdapters, api_settings: Settings
) -> None:
    with tenant.http() as http:
        response = http.post("/v1/adapters", files=adapter_files(peft_adapters.good), data={"suffix": "mine"})
    assert response.status_code == 200, response.text
    adapter = response.json()

    base = api_settings.model_name
    assert adapter["model"] == f"ft:{base}:{tenant.name}:mine:{adapter['id']}"
    assert (adapter["source"], adapter["rank"], adapter["alpha"]) == ("upload", 8, 16.0)
    assert adapter["target_modules"] == ["q_proj", "v_proj"]
    weights = (peft_adapters.good / ADAPTER_WEIGHTS_FILE).read_bytes()
    assert adapter["sha256"] == hashlib.sha256(weights).hexdigest()
    models = {m.id: m for m in tenant.openai().models.list()}
    assert set(models) == {base, adapter["model"]}
    assert (models[adapter["model"]].model_extra or {})["parent"] == base
    assert models[adapter["model"]].owned_by == tenant.name
    assert tenant.openai().models.retrieve(adapter["model"]).id == adapter["model"]
    stored = {o.key.rsplit("/", 1)[-1] for o in open_store(api_settings).list(f"tenants/{tenant.id}/adapters/")}
    assert stored == {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE}


def test_deleting_an_adapter_removes_its_model_and_files(
    tenant: TenantHandle, peft_adapters: PeftAdapters, api_settings: Settings
) -> None:
    client = tenant.openai()
    with tenant.http() as http:
        first = http.post("/v1/adapters", files=adapter_files(peft_adapters.good)).json()
        second = http.post("/v1/adapters", files=adapter_files(peft_adapters.good)).json()
        assert [a["id"] for a in http.get("/v1/adapters").json()["data"]] == [second["id"], first["id"]]

        assert http.delete(f"/v1/adapters/{first['id']}").json() == {
            "id": first["id"],
            "object": "adapter",
            "deleted": True,
        }
        assert http.get(f"/v1/adapters/{first['id']}").status_code == 404
    deleted = client.models.delete(second["model"])

    assert deleted.deleted and deleted.id == second["model"]
    assert [m.id for m in client.models.list()] == [api_settings.model_name]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(second["model"])
    assert open_store(api_settings).list(f"tenants/{tenant.id}/adapters/") == []


def test_an_adapter_records_the_base_it_was_accepted_for(
    tenant: TenantHandle, peft_adapters: PeftAdapters, api_settings: Settings
) -> None:
    """An adapter that records the served base (as trained ones do) uploads with no ``model`` field; the row
    keeps the fingerprint it was accepted for, which the descriptor hands to servers."""
    with tenant.http() as http:
        response = http.post("/v1/adapters", files=adapter_files(peft_adapters.made_here))
    assert response.status_code == 200, response.text
    with Session(make_engine(api_settings.db_url)) as session:
        row = session.get(Adapter, response.json()["id"])
    assert row is not None
    served = read_adapter_origin(peft_adapters.made_here / ADAPTER_WEIGHTS_FILE)
    assert served is not None and row.base_fingerprint == served.fingerprint == row.descriptor().base_fingerprint


def test_the_base_model_cannot_be_deleted(tenant: TenantHandle, api_settings: Settings) -> None:
    with pytest.raises(openai.PermissionDeniedError):
        tenant.openai().models.delete(api_settings.model_name or "")


@pytest.mark.parametrize(
    ("case", "fragment", "param"),
    [
        ("other_base", "the base needs [r, 128]", None),
        ("wide_rank", f"outside the served range 1..{TEST_MAX_LORA_RANK}", "r"),
        ("dora", "DoRA", "use_dora"),
        ("auto_map", "custom code", "auto_map"),
        ("missing_weights", f"lacks {ADAPTER_WEIGHTS_FILE}", ADAPTER_WEIGHTS_FILE),
        ("stray_file", "unexpected file", "notes"),
        ("twin_base", "made on base model 'tiny-twin'", "model"),
    ],
)
def test_mismatched_adapters_are_refused_saying_why(
    tenant: TenantHandle,
    peft_adapters: PeftAdapters,
    api_settings: Settings,
    case: str,
    fragment: str,
    param: str | None,
) -> None:
    parts = {
        "other_base": lambda: adapter_files(peft_adapters.other_base),
        "wide_rank": lambda: adapter_files(peft_adapters.wide_rank),
        "dora": lambda: adapter_files(peft_adapters.dora),
        "auto_map": lambda: with_config(peft_adapters.good, auto_map={"AutoModel": "evil.Model"}),
        "missing_weights": lambda: adapter_files(peft_adapters.good)[:1],
        "twin_base": lambda: adapter_files(peft_adapters.twin_base),
        "stray_file": lambda: [*adapter_files(peft_adapters.good), ("notes", ("notes.txt", b"hi", "text/plain"))],
    }[case]()

    with tenant.http() as http:
        response = http.post("/v1/adapters", files=parts)
        listed = http.get("/v1/adapters").json()["data"]

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error
    if param is not None:
        assert error["param"] == param
    assert listed == []
    assert open_store(api_settings).list(f"tenants/{tenant.id}/") == []


def test_a_pickle_weights_file_is_refused_and_never_unpickled(
    tenant: TenantHandle, peft_adapters: PeftAdapters, api_settings: Settings, tmp_path: Path
) -> None:
    marker = tmp_path / "unpickled"
    config = adapter_files(peft_adapters.good)[0]
    pickled = ("adapter_model.bin", ("adapter_model.bin", pickle_payload(marker), "application/octet-stream"))

    with tenant.http() as http:
        response = http.post("/v1/adapters", files=[config, pickled])

    assert response.status_code == 400
    assert "pickle file, which is never loaded" in response.json()["error"]["message"]
    assert not marker.exists()
    assert open_store(api_settings).list(f"tenants/{tenant.id}/") == []
