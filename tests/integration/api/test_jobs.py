"""/v1/fine_tuning/jobs without a worker: validation, queueing, listing, events, cancellation, Redis down."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from sqlmodel import select

from api.job_submission import queue_validated
from core.db import make_engine, session_scope
from core.hyperparameters import Hyperparameters
from core.ids import new_id
from core.job_states import IllegalTransition
from core.models import FineTuneJob, JobStatus
from core.settings import Settings
from tests.integration.api.conftest import TenantHandle
from tests.integration.api.datasets import chat_jsonl


@pytest.fixture
def training_file(tenant: TenantHandle) -> str:
    return tenant.openai().files.create(file=("train.jsonl", chat_jsonl()), purpose="fine-tune").id


def set_job_status(settings: Settings, job_id: str, status: str) -> None:
    """Move a job as a worker would (these tests run none)."""
    with session_scope(make_engine(settings.db_url)) as session:
        job = session.get(FineTuneJob, job_id)
        assert job is not None
        job.status = status
        session.add(job)


def test_a_job_is_queued_with_resolved_hyperparameters_and_events(
    tenant: TenantHandle, training_file: str, api_settings: Settings
) -> None:
    client = tenant.openai()

    job = client.fine_tuning.jobs.create(
        model=api_settings.model_name or "",
        training_file=training_file,
        hyperparameters={"n_epochs": 2, "batch_size": 4},
        suffix="math-v1",
        seed=7,
    )

    assert (job.object, job.status, job.model, job.seed) == ("fine_tuning.job", "queued", api_settings.model_name, 7)
    assert job.fine_tuned_model is None and job.organization_id == tenant.id
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 4
    extra = job.hyperparameters.model_extra or {}
    assert extra["lora_r"] == 8 and extra["lora_alpha"] == 16.0 and len(extra["target_modules"]) == 7
    assert job.method is not None and job.method.type == "supervised"
    assert client.fine_tuning.jobs.retrieve(job.id).status == "queued"
    assert [j.id for j in client.fine_tuning.jobs.list()] == [job.id]
    messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id)]
    assert messages == ["Files validated, moving job to queued state", f"Created fine-tuning job: {job.id}"]

    # "auto" follows the training file's size (12 examples): 8 epochs to see about 100, batches of 1.
    auto = client.fine_tuning.jobs.create(model=api_settings.model_name or "", training_file=training_file)
    assert (auto.hyperparameters.n_epochs, auto.hyperparameters.batch_size) == (8, 1)


def test_hyperparameters_may_come_through_method(
    tenant: TenantHandle, training_file: str, api_settings: Settings
) -> None:
    job = tenant.openai().fine_tuning.jobs.create(
        model=api_settings.model_name or "",
        training_file=training_file,
        method={"type": "supervised", "supervised": {"hyperparameters": {"learning_rate_multiplier": 2.0}}},
    )

    assert job.hyperparameters.learning_rate_multiplier == 2.0
    assert (job.hyperparameters.model_extra or {})["learning_rate"] == pytest.approx(4e-4)


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"model": "gpt-4o-mini"}, "model"),
        ({"model": "ft:tiny:someone::ftjob-1"}, "model"),
        ({"training_file": "file-doesnotexist"}, "training_file"),
        ({"validation_file": "file-doesnotexist"}, "validation_file"),
        ({"hyperparameters": {"lora_r": 0}}, "hyperparameters.lora_r"),
        ({"hyperparameters": {"lora_r": 100000}}, "hyperparameters.lora_r"),
        ({"hyperparameters": {"learning_rate": -0.1}}, "hyperparameters.learning_rate"),
        ({"hyperparameters": {"n_epochs": 10**6}}, "hyperparameters.n_epochs"),
        ({"hyperparameters": {"batch_size": "huge"}}, "hyperparameters.batch_size"),
        ({"hyperparameters": {"max_seq_len": 10**6}}, "hyperparameters.max_seq_len"),
        ({"hyperparameters": {"target_modules": ["lm_head"]}}, "hyperparameters.target_modules"),
        ({"hyperparameters": {"warmup": 3}}, "hyperparameters.warmup"),
        ({"method": {"type": "reinforcement"}}, "method.type"),
        ({"method": {"type": "dpo"}}, "training_file"),  # a chat file: DPO trains on preference pairs
        ({"suffix": "has:colon"}, "suffix"),
        ({"suffix": "x" * 65}, "suffix"),
        ({"seed": -1}, "seed"),
        ({"metadata": {f"key{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"note": "v" * 513}}, "metadata"),
        ({"metadata": {"count": 3}}, "metadata.count"),
        ({"metadata": {'say "hi"': "v"}}, "metadata"),
    ],
)
def test_bad_job_requests_name_the_field(
    tenant: TenantHandle, training_file: str, api_settings: Settings, overrides: dict[str, Any], param: str
) -> None:
    body = {"model": api_settings.model_name, "training_file": training_file, **overrides}

    with pytest.raises(openai.BadRequestError) as caught:
        tenant.openai().fine_tuning.jobs.create(**body)

    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param, caught.value.body
    assert list(tenant.openai().fine_tuning.jobs.list()) == []


def test_jobs_keep_their_metadata_and_the_list_filters_by_it(
    tenant: TenantHandle, training_file: str, api_settings: Settings
) -> None:
    client = tenant.openai()
    model = api_settings.model_name or ""
    search = client.fine_tuning.jobs.create(model=model, training_file=training_file, metadata={"team": "search"})
    tagged = {"team": "ads", "experiment": "lr-sweep/3"}
    ads = client.fine_tuning.jobs.create(model=model, training_file=training_file, metadata=tagged)
    plain = client.fine_tuning.jobs.create(model=model, training_file=training_file)

    assert client.fine_tuning.jobs.retrieve(ads.id).metadata == tagged and plain.metadata is None

    def found(metadata: dict[str, str]) -> list[str]:
        return [job.id for job in client.fine_tuning.jobs.list(metadata=metadata)]

    assert found({"team": "search"}) == [search.id]
    assert found({"team": "ads", "experiment": "lr-sweep/3"}) == [ads.id]
    assert found({"team": "ads", "experiment": "other"}) == []
    assert found({}) == [plain.id, ads.id, search.id]
    with tenant.http() as http:
        without = http.get("/v1/fine_tuning/jobs", params={"metadata": "null"}).json()["data"]
        refused = http.get("/v1/fine_tuning/jobs", params={"metadata": "team"})
    assert [job["id"] for job in without] == [plain.id]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"


def test_cancel_ends_a_queued_job_and_a_finished_job_is_a_conflict(
    tenant: TenantHandle, training_file: str, api_settings: Settings
) -> None:
    client = tenant.openai()
    job = client.fine_tuning.jobs.create(model=api_settings.model_name or "", training_file=training_file)

    cancelled = client.fine_tuning.jobs.cancel(job.id)

    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    assert client.fine_tuning.jobs.cancel(job.id).status == "cancelled"  # idempotent
    assert client.fine_tuning.jobs.list_events(job.id, limit=1).data[0].message == "Job cancelled before it started"

    other = client.fine_tuning.jobs.create(model=api_settings.model_name or "", training_file=training_file)
    set_job_status(api_settings, other.id, JobStatus.FAILED)
    with pytest.raises(openai.ConflictError) as caught:
        client.fine_tuning.jobs.cancel(other.id)
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert caught.value.code == "job_not_cancellable" and "already failed" in caught.value.message
    assert client.fine_tuning.jobs.retrieve(other.id).status == "failed"  # the refused cancel changed nothing
    assert "cancel" not in client.fine_tuning.jobs.list_events(other.id, limit=1).data[0].message.lower()


def test_a_job_cancelled_while_its_files_are_checked_is_not_queued_after_all(
    tenant: TenantHandle, training_file: str, api_settings: Settings
) -> None:
    # A submission between creating the row and queueing it, as the API leaves it while it checks the files.
    engine = make_engine(api_settings.db_url)
    job_id = new_id("ftjob")
    hyperparameters = Hyperparameters().resolve(max_lora_rank=api_settings.max_lora_rank).model_dump()
    with session_scope(engine) as session:
        session.add(
            FineTuneJob(
                id=job_id,
                tenant_id=tenant.id,
                base_model=api_settings.model_name or "",
                training_file=training_file,
                hyperparameters=hyperparameters,
            )
        )
    client = tenant.openai()
    assert client.fine_tuning.jobs.retrieve(job_id).status == "validating_files"
    client.fine_tuning.jobs.cancel(job_id)

    with pytest.raises(IllegalTransition, match="already cancelled"), session_scope(engine) as session:
        queue_validated(session, job_id, {"training_file": 3})
    engine.dispose()

    assert client.fine_tuning.jobs.retrieve(job_id).status == "cancelled"
    assert client.fine_tuning.jobs.list_events(job_id, limit=1).data[0].message == "Job cancelled before it started"


def test_a_file_in_use_by_an_unfinished_job_cannot_be_deleted(
    tenant: TenantHandle, training_file: str, api_settings: Settings
) -> None:
    client = tenant.openai()
    job = client.fine_tuning.jobs.create(model=api_settings.model_name or "", training_file=training_file)

    with pytest.raises(openai.ConflictError) as caught:
        client.files.delete(training_file)

    assert job.id in caught.value.message
    client.fine_tuning.jobs.cancel(job.id)
    assert client.files.delete(training_file).deleted


def test_jobs_and_events_page_with_after_and_limit(
    tenant: TenantHandle, training_file: str, api_settings: Settings
) -> None:
    client = tenant.openai()
    ids = [
        client.fine_tuning.jobs.create(model=api_settings.model_name or "", training_file=training_file).id
        for _ in range(3)
    ]

    page = client.fine_tuning.jobs.list(limit=2)
    events = client.fine_tuning.jobs.list_events(ids[0], limit=1)

    assert [j.id for j in page.data] == ids[::-1][:2] and page.has_more
    assert [j.id for j in client.fine_tuning.jobs.list(limit=2, after=page.data[-1].id).data] == [ids[0]]
    assert events.has_more and len(events.data) == 1
    older = client.fine_tuning.jobs.list_events(ids[0], after=events.data[0].id)
    assert [e.message for e in older.data] == [f"Created fine-tuning job: {ids[0]}"] and not older.has_more
    with pytest.raises(openai.BadRequestError):
        client.fine_tuning.jobs.list_events(ids[0], after="not-an-event")


def test_redis_down_is_a_503_with_retry_after_and_leaves_no_job(
    tenant: TenantHandle, training_file: str, api_settings: Settings, api_without_redis: str
) -> None:
    client = TenantHandle(tenant.id, tenant.name, tenant.key, api_without_redis).openai()

    with pytest.raises(openai.InternalServerError) as caught:
        client.fine_tuning.jobs.create(model=api_settings.model_name or "", training_file=training_file)

    assert caught.value.status_code == 503
    assert int(caught.value.response.headers["retry-after"]) > 0
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "queue_unavailable"
    with session_scope(make_engine(api_settings.db_url)) as session:
        assert session.exec(select(FineTuneJob).where(FineTuneJob.tenant_id == tenant.id)).all() == []
    assert list(tenant.openai().fine_tuning.jobs.list()) == []
