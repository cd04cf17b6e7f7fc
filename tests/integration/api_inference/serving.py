"""The session's serving deployment: an API, two real inference server replicas, a training worker, and
an adapter fine-tuned through the public API (the way a tenant gets one).

A pytest plugin (``pytest_plugins`` in ``tests/conftest.py``) rather than a conftest, so the inference
tests, the security sweep and the load test share one deployment per session instead of starting their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from core.local_services import EmbeddedRedis
from tests.integration.api.conftest import TenantHandle
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api.peft_adapters import adapter_files, make_peft_adapter
from tests.integration.api_inference.deployment import Deployment, deploy
from tests.integration.conftest import launch_worker
from tests.services import S3Service

REPLICAS = ["replica-a", "replica-b"]


@pytest.fixture(scope="session")
def serving(
    tmp_path_factory: pytest.TempPathFactory, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Deployment]:
    """API + two replicas + a worker, shared by the inference tests (each test uses its own tenants)."""
    workdir = tmp_path_factory.mktemp("serving")
    deployment = deploy(workdir, redis_service.url, s3_service, tiny_model_dir)
    try:
        deployment.processes.append(launch_worker(deployment.settings, workdir / "worker.log"))
        deployment.start_replicas(tiny_model_dir, REPLICAS, workdir)
        yield deployment
    finally:
        deployment.stop()


@dataclass(frozen=True)
class TrainedAdapter:
    owner: TenantHandle
    model: str
    adapter_id: str
    job_id: str


@pytest.fixture(scope="session")
def trained_adapter(serving: Deployment) -> TrainedAdapter:
    """An adapter fine-tuned by a real job on the worker (its success announces a prefetch)."""
    owner = serving.make_tenant()
    client = owner.openai()
    training = client.files.create(file=("train.jsonl", chat_jsonl(10)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=serving.base_model,
        training_file=training.id,
        hyperparameters={"n_epochs": 1, "batch_size": 4, "lora_r": 4},
        suffix="serve",
    )

    def finished():  # type: ignore[no-untyped-def]
        current = client.fine_tuning.jobs.retrieve(job.id)
        return current if current.status in ("succeeded", "failed", "cancelled") else None

    final = serving.wait_until(finished, f"fine-tuning job {job.id}", timeout=300)
    assert final.status == "succeeded", final.error
    assert final.fine_tuned_model is not None
    with owner.http() as http:
        adapters = http.get("/v1/adapters").json()["data"]
    [adapter] = [a for a in adapters if a["model"] == final.fine_tuned_model]  # the others are its checkpoints
    return TrainedAdapter(owner, final.fine_tuned_model, adapter["id"], job.id)


@pytest.fixture(scope="session")
def peft_adapter_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A PEFT LoRA for the tiny base, to upload (bring-your-own) where a trained one is not needed."""
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft") / "adapter", r=4)


def upload_adapter(tenant: TenantHandle, adapter_dir: Path) -> dict:
    """Upload a PEFT adapter for ``tenant``; its adapter object (``model``, ``id``)."""
    with tenant.http() as http:
        response = http.post("/v1/adapters", files=adapter_files(adapter_dir))
    assert response.status_code == 200, response.text
    return response.json()
