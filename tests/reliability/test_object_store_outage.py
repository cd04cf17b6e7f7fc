"""The object store goes down and comes back: uploads and adapter loads in between get a retryable 503
that names no internals and store nothing, half or whole; inference that needs no store goes on; a job
that meets the outage waits it out (the outage is not charged to its attempts) and finishes exactly once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from core.local_services import EmbeddedRedis
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api.peft_adapters import adapter_files
from tests.integration.api_inference.deployment import Deployment, deploy
from tests.reliability.stack import (
    TINY_JOB,
    assert_retryable_outage,
    assert_succeeded_once,
    holdings,
    job_ended,
    job_events,
    worker_on,
)
from tests.services import S3Service, restart_seaweed_s3, start_seaweed_s3

pytestmark = pytest.mark.slow
UPLOAD = {"purpose": "fine-tune"}


@pytest.fixture(scope="module")
def private_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Service]:
    """SeaweedFS of this module's own, to stop and restart."""
    s3 = start_seaweed_s3(tmp_path_factory.mktemp("private-seaweed"))
    yield s3
    s3.stop()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_service: EmbeddedRedis, private_s3: S3Service, tiny_model_dir: Path
) -> Iterator[Deployment]:
    """An API and one replica on the private store (a worker joins in the test that trains)."""
    workdir = tmp_path_factory.mktemp("store-outage")
    deployment = deploy(workdir, redis_service.url, private_s3, tiny_model_dir)
    try:
        deployment.start_replicas(tiny_model_dir, [f"replica-{uuid.uuid4().hex[:6]}"], workdir)
        yield deployment
    finally:
        deployment.stop()


def test_uploads_and_adapter_loads_during_an_outage_are_retryable_and_leave_nothing(
    stack: Deployment, private_s3: S3Service, peft_adapter_dir: Path
) -> None:
    tenant = stack.make_tenant()
    base = {"model": stack.base_model, "prompt": "hi", "max_tokens": 2}
    with tenant.http() as http:
        adapter = http.post("/v1/adapters", files=adapter_files(peft_adapter_dir)).json()  # stored, not yet loaded
        before = holdings(stack, tenant)

        private_s3.stop()
        refused = [
            http.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl())}, data=UPLOAD),
            http.post("/v1/adapters", files=adapter_files(peft_adapter_dir)),
        ]
        for response in refused:
            assert_retryable_outage(response, "storage_unavailable")
            assert "object store is unavailable" in response.json()["error"]["message"]
            assert private_s3.endpoint not in response.text and stack.settings.s3_bucket not in response.text
        for stream in (False, True):
            cold = http.post("/v1/completions", json={**base, "model": adapter["model"], "stream": stream})
            assert_retryable_outage(cold, "storage_unavailable")
            assert "adapter could not be loaded" in cold.json()["error"]["message"]
        plain = http.post("/v1/completions", json=base)  # the base model needs no store
        assert plain.status_code == 200, plain.text
        billed = plain.json()["usage"]["total_tokens"]  # the one request that was served is billed, nothing else
        assert [a["id"] for a in http.get("/v1/adapters").json()["data"]] == [adapter["id"]]

        restart_seaweed_s3(private_s3)
        # no row, no object, not even half of one
        assert holdings(stack, tenant) == replace(before, billed_tokens=before.billed_tokens + billed)

        def served() -> bool:
            answer = http.post("/v1/completions", json={**base, "model": adapter["model"]})
            assert answer.status_code in (200, 503), answer.text
            return answer.status_code == 200

        stack.wait_until(served, "the adapter to load once the store is back", timeout=90)
        assert http.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl())}, data=UPLOAD).status_code == 200


def test_a_job_that_meets_the_outage_waits_it_out_and_finishes_once(
    stack: Deployment, private_s3: S3Service, tmp_path: Path
) -> None:
    tenant = stack.make_tenant()
    with tenant.http() as http:
        file_id = http.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl())}, data=UPLOAD).json()["id"]
        body = {"model": stack.base_model, "training_file": file_id, "hyperparameters": TINY_JOB}
        job_id = http.post("/v1/fine_tuning/jobs", json=body).json()["id"]

    private_s3.stop()  # before any worker takes the job: its attempt finds the training file unreachable
    with worker_on(stack, tmp_path / "worker.log"):
        interrupted = lambda: any("Training was interrupted" in e for e in job_events(stack, job_id))  # noqa: E731
        stack.wait_until(interrupted, "the job to meet the outage", timeout=120)
        restart_seaweed_s3(private_s3)
        stack.wait_until(lambda: job_ended(stack, job_id), "the job to end", timeout=300)

    job, adapter = assert_succeeded_once(stack, job_id)
    assert job.attempts == 1 and job.transient_failures >= 1  # the outage cost no attempt
    assert len([k for k in holdings(stack, tenant).objects if k.startswith(adapter.storage_prefix)]) == 3
