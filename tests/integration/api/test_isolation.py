"""Tenant isolation on every route: tenant B gets 404 for tenant A's files, jobs, adapters and models,
with the same answer as for ids that never existed, and A's things are untouched afterwards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from core.settings import Settings
from tests.integration.api.conftest import PeftAdapters, TenantHandle
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api.peft_adapters import adapter_files


@dataclass(frozen=True)
class Owned:
    file_id: str
    job_id: str
    adapter_id: str
    model: str


@pytest.fixture
def owned_by_a(tenant: TenantHandle, peft_adapters: PeftAdapters, api_settings: Settings) -> Owned:
    client = tenant.openai()
    file_id = client.files.create(file=("a.jsonl", chat_jsonl()), purpose="fine-tune").id
    job_id = client.fine_tuning.jobs.create(model=api_settings.model_name or "", training_file=file_id).id
    with tenant.http() as http:
        adapter = http.post("/v1/adapters", files=adapter_files(peft_adapters.good)).json()
    return Owned(file_id, job_id, adapter["id"], adapter["model"])


SDK_CALLS: dict[str, Callable[[openai.OpenAI, Owned], Any]] = {
    "files.retrieve": lambda c, o: c.files.retrieve(o.file_id),
    "files.content": lambda c, o: c.files.content(o.file_id),
    "files.delete": lambda c, o: c.files.delete(o.file_id),
    "jobs.retrieve": lambda c, o: c.fine_tuning.jobs.retrieve(o.job_id),
    "jobs.cancel": lambda c, o: c.fine_tuning.jobs.cancel(o.job_id),
    "jobs.list_events": lambda c, o: c.fine_tuning.jobs.list_events(o.job_id),
    "jobs.checkpoints.list": lambda c, o: c.fine_tuning.jobs.checkpoints.list(o.job_id),
    "models.retrieve": lambda c, o: c.models.retrieve(o.model),
    "models.delete": lambda c, o: c.models.delete(o.model),
}


@pytest.mark.parametrize("call", sorted(SDK_CALLS))
def test_another_tenants_resources_are_not_found(
    call: str, owned_by_a: Owned, tenant: TenantHandle, other_tenant: TenantHandle
) -> None:
    never_existed = Owned("file-x", "ftjob-x", "adapter-x", "ft:x:y::z")

    with pytest.raises(openai.NotFoundError) as foreign:
        SDK_CALLS[call](other_tenant.openai(), owned_by_a)
    with pytest.raises(openai.NotFoundError) as missing:
        SDK_CALLS[call](other_tenant.openai(), never_existed)

    assert isinstance(foreign.value.body, dict) and isinstance(missing.value.body, dict)
    assert foreign.value.body["code"] == missing.value.body["code"]
    assert_untouched(tenant, owned_by_a)


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_another_tenants_adapters_are_not_found(
    method: str, owned_by_a: Owned, tenant: TenantHandle, other_tenant: TenantHandle
) -> None:
    with other_tenant.http() as http:
        response = http.request(method, f"/v1/adapters/{owned_by_a.adapter_id}")

    assert response.status_code == 404
    assert_untouched(tenant, owned_by_a)


def test_another_tenants_file_cannot_be_trained_on(
    owned_by_a: Owned, other_tenant: TenantHandle, api_settings: Settings
) -> None:
    client = other_tenant.openai()

    with pytest.raises(openai.BadRequestError) as foreign:
        client.fine_tuning.jobs.create(model=api_settings.model_name or "", training_file=owned_by_a.file_id)

    assert isinstance(foreign.value.body, dict) and foreign.value.body["param"] == "training_file"
    assert foreign.value.body["message"] == f"no file with id {owned_by_a.file_id!r}; upload it with POST /v1/files"


def test_lists_show_only_the_callers_own(owned_by_a: Owned, other_tenant: TenantHandle, api_settings: Settings) -> None:
    client = other_tenant.openai()

    assert list(client.files.list()) == []
    assert list(client.fine_tuning.jobs.list()) == []
    assert [m.id for m in client.models.list()] == [api_settings.model_name]
    with other_tenant.http() as http:
        assert http.get("/v1/adapters").json()["data"] == []


def assert_untouched(tenant: TenantHandle, owned: Owned) -> None:
    client = tenant.openai()
    assert client.files.retrieve(owned.file_id).id == owned.file_id
    assert client.fine_tuning.jobs.retrieve(owned.job_id).status == "queued"
    assert client.models.retrieve(owned.model).id == owned.model
