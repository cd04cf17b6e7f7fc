"""The whole path through the openai SDK: upload, fine-tune on a real Celery worker (real Redis, real S3),
follow the job to ``succeeded``, and find the adapter among the models; then DPO on top of it."""

from __future__ import annotations

import csv
import io
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, OpenAI
from openai.types.fine_tuning import FineTuningJob

from api.app import create_app
from core.local_services import EmbeddedRedis, ManagedProcess
from core.settings import Settings
from tests.integration.api.conftest import TenantHandle, api_settings_for
from tests.integration.api.datasets import chat_jsonl, preference_jsonl
from tests.integration.api.live_server import LiveServer, serve
from tests.integration.conftest import launch_worker
from tests.services import S3Service

pytestmark = pytest.mark.slow
TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class Deployment:
    settings: Settings
    server: LiveServer
    worker: ManagedProcess


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Deployment]:
    """An API and a worker sharing one database, bucket and queue (its own base model name: its own queue)."""
    workdir = tmp_path_factory.mktemp("e2e")
    settings = api_settings_for(
        workdir, redis_service.url, s3_service, tiny_model_dir, base_model_name=f"tiny-{uuid.uuid4().hex[:8]}"
    )
    server = serve(create_app(settings))
    worker = launch_worker(settings, workdir / "worker.log")
    yield Deployment(settings, server, worker)
    worker.stop()
    server.stop()


def follow(client: OpenAI, job_id: str, worker: ManagedProcess, timeout: float = 300.0) -> FineTuningJob:
    """Poll the job through the SDK until it ends (failing early, with the worker's log, if the worker died)."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in TERMINAL:
            return job
        if not worker.alive():
            pytest.fail(f"the worker exited while job {job_id} was {job.status}:\n{worker.log_tail(60)}")
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} still {job.status} after {timeout:.0f}s; worker log:\n{worker.log_tail(60)}")
        time.sleep(0.25)  # pacing between polls; the loop waits on the job's status, not on time


def new_tenant(deployment: Deployment, name: str) -> TenantHandle:
    """A tenant made as an admin makes one, through the API."""
    assert deployment.settings.admin_key is not None
    created = httpx.post(
        f"{deployment.server.url}/admin/tenants",
        json={"name": name},
        headers={"Authorization": f"Bearer {deployment.settings.admin_key.get_secret_value()}"},
    ).json()
    return TenantHandle(created["id"], created["name"], created["api_key"]["key"], deployment.server.url)


def test_upload_fine_tune_and_call_it_by_name(deployment: Deployment) -> None:
    settings = deployment.settings
    tenant = new_tenant(deployment, "e2e-acme")
    client = tenant.openai()
    base = settings.model_name or ""

    training = client.files.create(file=("train.jsonl", chat_jsonl(12)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=base,
        training_file=training.id,
        hyperparameters={"n_epochs": 2, "batch_size": 4, "lora_r": 4},
        suffix="e2e",
        seed=3,
    )
    assert job.status == "queued"

    final = follow(client, job.id, deployment.worker)

    assert final.status == "succeeded", final.error
    assert final.fine_tuned_model == f"ft:{base}:e2e-acme:e2e:{job.id}"
    assert final.trained_tokens and final.trained_tokens > 0
    assert final.finished_at is not None and final.finished_at >= final.created_at
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=5))  # the SDK pages through all of them
    messages = [e.message for e in events]
    assert messages[0] == "The job has successfully completed"
    assert messages[-1] == f"Created fine-tuning job: {job.id}"
    assert "Fine-tuning job started" in messages
    assert any(e.type == "metrics" for e in events)

    # Its metrics file: one row per step, as OpenAI's step_metrics.csv.
    [results] = final.result_files
    assert (client.files.retrieve(results).purpose, client.files.retrieve(results).filename) == (
        "fine-tune-results",
        "step_metrics.csv",
    )
    rows = list(csv.DictReader(io.StringIO(client.files.content(results).text)))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(0 <= float(r["train_mean_token_accuracy"]) <= 1 for r in rows)
    losses = {e.data["step"]: e.data["train_loss"] for e in events if e.type == "metrics" and e.data}
    assert [float(r["train_loss"]) for r in rows] == pytest.approx([losses[step] for step in range(1, 7)])

    # Each epoch left a checkpoint (12 examples in batches of 4: 3 steps an epoch), servable by its own name.
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert [c.step_number for c in checkpoints] == [6, 3]  # newest first
    assert [c.metrics.train_loss for c in checkpoints] == pytest.approx([losses[6], losses[3]])
    names = [c.fine_tuned_model_checkpoint for c in checkpoints]
    assert names == [f"{final.fine_tuned_model}:ckpt-step-{step}" for step in (6, 3)]

    models = {m.id: m for m in client.models.list()}
    assert set(models) == {base, final.fine_tuned_model, *names}
    assert (models[final.fine_tuned_model].model_extra or {})["parent"] == base
    with tenant.http() as http:
        adapters = {a["model"]: a for a in http.get("/v1/adapters").json()["data"]}
    adapter = adapters[final.fine_tuned_model]
    assert (adapter["model"], adapter["source"], adapter["job_id"], adapter["rank"]) == (
        final.fine_tuned_model,
        "fine_tune",
        job.id,
        4,
    )
    assert [(adapters[n]["source"], adapters[n]["job_id"]) for n in names] == [("checkpoint", job.id)] * 2


def test_cancelling_a_running_job_answers_cancelled_once_its_step_ends(deployment: Deployment) -> None:
    settings = deployment.settings
    client = new_tenant(deployment, "e2e-quitter").openai()
    training = client.files.create(file=("train.jsonl", chat_jsonl(12)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=settings.model_name or "", training_file=training.id, hyperparameters={"n_epochs": 100, "batch_size": 4}
    )

    def training_steps() -> int:
        return sum(1 for e in client.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics")

    deadline = time.monotonic() + 120
    while training_steps() < 3:
        assert time.monotonic() < deadline and deployment.worker.alive(), deployment.worker.log_tail(40)
        time.sleep(0.25)  # pacing between polls

    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"  # not "running": the answer waited for the step to end
    assert cancelled.finished_at is not None and cancelled.fine_tuned_model is None
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"


def test_dpo_continues_a_fine_tuned_model_from_preference_pairs(deployment: Deployment) -> None:
    base = deployment.settings.model_name or ""
    tenant = new_tenant(deployment, "e2e-prefers")
    client = tenant.openai()
    chats = client.files.create(file=("train.jsonl", chat_jsonl(12)), purpose="fine-tune")
    pairs = client.files.create(file=("pairs.jsonl", preference_jsonl(12)), purpose="fine-tune")
    assert (pairs.model_extra or {})["format"] == "preference"
    sft = client.fine_tuning.jobs.create(
        model=base, training_file=chats.id, hyperparameters={"n_epochs": 1, "batch_size": 4, "lora_r": 4}, suffix="sft"
    )
    parent = follow(client, sft.id, deployment.worker)
    assert parent.status == "succeeded", parent.error
    assert parent.fine_tuned_model is not None
    dpo = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 2, "batch_size": 4}}}

    # What cannot work is refused before anything is queued, naming the field to fix.
    someone_else = new_tenant(deployment, "e2e-other").openai()
    theirs = someone_else.files.create(file=("pairs.jsonl", preference_jsonl(12)), purpose="fine-tune")
    refused = [
        (dict(model=base, training_file=chats.id, method=dpo), "training_file", "preference pairs"),
        (dict(model=base, training_file=pairs.id), "training_file", "method 'dpo'"),
        (dict(model=base, training_file=pairs.id, hyperparameters={"beta": 0.2}), "hyperparameters.beta", "dpo"),
        (
            dict(
                model=parent.fine_tuned_model,
                training_file=pairs.id,
                method={**dpo, "dpo": {"hyperparameters": {"lora_r": 8}}},
            ),
            "method.dpo.hyperparameters.lora_r",
            "leave lora_r out",
        ),
    ]
    for fields, param, says in refused:
        with pytest.raises(BadRequestError) as caught:
            client.fine_tuning.jobs.create(**fields)  # type: ignore[call-overload]
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param and says in error["message"], error
    with pytest.raises(BadRequestError) as caught:  # another tenant's model reads like one that does not exist
        someone_else.fine_tuning.jobs.create(model=parent.fine_tuned_model, training_file=theirs.id, method=dpo)
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "model_not_available"

    job = client.fine_tuning.jobs.create(
        model=parent.fine_tuned_model, training_file=pairs.id, method=dpo, suffix="dpo"
    )
    assert (job.model, job.method.type) == (parent.fine_tuned_model, "dpo")
    assert job.method.dpo is not None and job.method.dpo.hyperparameters.beta == 0.2
    assert (job.hyperparameters.model_extra or {})["lora_r"] == 4  # the parent's adapter, continued

    final = follow(client, job.id, deployment.worker)

    assert final.status == "succeeded", final.error
    assert final.fine_tuned_model == f"ft:{base}:e2e-prefers:dpo:{job.id}"
    [results] = final.result_files
    rows = list(csv.DictReader(io.StringIO(client.files.content(results).text)))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["train_reward_margin"] and 0 <= float(r["train_reward_accuracy"]) <= 1 for r in rows)
    assert [c.step_number for c in client.fine_tuning.jobs.checkpoints.list(job.id)] == [6, 3]
    models = {m.id: m for m in client.models.list()}
    assert (models[final.fine_tuned_model].model_extra or {})["parent"] == base  # one adapter on the base
    with tenant.http() as http:
        adapters = {a["model"]: a for a in http.get("/v1/adapters").json()["data"]}
    assert adapters[final.fine_tuned_model]["rank"] == 4
