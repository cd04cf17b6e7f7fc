"""Redis goes away and comes back empty (no persistence): while it is down, every route that needs it
answers 503 with ``retry-after`` and the rest keep working; once it is back the API serves again by itself,
and jobs whose queue messages it forgot still run, each exactly once, even when delivered twice at once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from core.jobs import enqueue_job
from core.local_services import EmbeddedRedis
from core.queue import make_celery, train_queue, waiting_job_ids
from core.storage import open_store
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api.peft_adapters import adapter_files
from tests.integration.api_inference.deployment import Deployment, deploy
from tests.integration.conftest import launch_worker
from tests.reliability.stack import (
    TINY_JOB,
    assert_retryable_outage,
    assert_succeeded_once,
    job_ended,
    job_events,
    job_row,
)
from tests.services import S3Service, restart_redis

pytestmark = pytest.mark.slow
LOST = "The job's place in the queue was lost (the queue restarted); queued it again"


@pytest.fixture
def stack(
    tmp_path: Path, private_redis: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Deployment]:
    """An API on the private Redis (workers join in the test that needs them)."""
    deployment = deploy(tmp_path / "api", private_redis.url, s3_service, tiny_model_dir)
    yield deployment
    deployment.stop()


def create_job(http: httpx.Client, deployment: Deployment, file_id: str) -> httpx.Response:
    body = {"model": deployment.base_model, "training_file": file_id, "hyperparameters": TINY_JOB}
    return http.post("/v1/fine_tuning/jobs", json=body)


def test_while_redis_is_down_only_what_needs_it_is_refused_and_it_recovers_by_itself(
    stack: Deployment, private_redis: EmbeddedRedis, peft_adapter_dir: Path
) -> None:
    tenant = stack.make_tenant(requests_per_minute=1000)  # its requests pass through the Redis rate limiter
    prompt = {"model": stack.base_model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": stack.base_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with tenant.http() as http:
        file_id = http.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl())}, data={"purpose": "fine-tune"})
        file_id = file_id.json()["id"]
        adapter = http.post("/v1/adapters", files=adapter_files(peft_adapter_dir)).json()

        private_redis.stop()
        assert_retryable_outage(create_job(http, stack, file_id), "queue_unavailable")
        for path, body in [("/v1/completions", prompt), ("/v1/chat/completions", chat)]:
            for stream in (False, True):
                assert_retryable_outage(http.post(path, json={**body, "stream": stream}), "redis_unavailable")
        assert_retryable_outage(http.get("/ready"), "queue_unavailable")
        assert "127.0.0.1" not in http.get("/ready").text  # who asks /ready learns what is down, not where
        # What needs only the database and the object store keeps working; unloading a deleted adapter
        # from the servers is best effort (they evict idle adapters anyway).
        assert http.get("/v1/fine_tuning/jobs").json()["data"] == []
        assert [f["id"] for f in http.get("/v1/files").json()["data"]] == [file_id]
        assert http.delete(f"/v1/adapters/{adapter['id']}").status_code == 200
        with stack.admin() as admin:
            assert admin.get("/admin").status_code == 200  # the dashboard says replicas cannot be listed

        restart_redis(private_redis)
        stack.wait_until(lambda: http.get("/ready").status_code == 200, "the API to see Redis again", timeout=30)
        created = create_job(http, stack, file_id)
        assert created.status_code == 200, created.text
        assert [j["id"] for j in http.get("/v1/fine_tuning/jobs").json()["data"]] == [created.json()["id"]]
        assert http.post("/v1/completions", json=prompt).json()["error"]["code"] == "no_replica"  # past Redis


def test_jobs_whose_messages_redis_forgot_still_run_each_exactly_once(
    stack: Deployment, private_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    tenant = stack.make_tenant()
    celery = make_celery(stack.settings)
    queue = train_queue(stack.base_model)
    with tenant.http() as http:
        data = {"purpose": "fine-tune"}
        file_id = http.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl())}, data=data).json()["id"]
        forgotten = [create_job(http, stack, file_id).json()["id"] for _ in range(2)]
        assert waiting_job_ids(celery, queue) == set(forgotten)

        private_redis.stop()
        restart_redis(private_redis)
        assert waiting_job_ids(celery, queue) == set()  # the fault: Redis came back without the messages
        fresh = create_job(http, stack, file_id).json()["id"]
    # Two deliveries of the same job at once: a second message, and two workers to take both together.
    enqueue_job(celery, job_row(stack, fresh))
    assert waiting_job_ids(celery, queue) == {fresh}
    for n in range(2):
        stack.processes.append(launch_worker(stack.settings, tmp_path / f"worker-{n}.log"))

    jobs = [*forgotten, fresh]
    stack.wait_until(lambda: all(job_ended(stack, j) for j in jobs), "every job to end", timeout=300)
    celery.close()

    for job_id in jobs:
        job, adapter = assert_succeeded_once(stack, job_id)
        assert job.attempts == 1 and job_events(stack, job_id).count("Fine-tuning job started") == 1
        stored = open_store(stack.settings).list(adapter.storage_prefix)
        assert len(stored) == 3  # config, weights, manifest: one adapter's worth, not two
    for job_id in forgotten:
        assert LOST in job_events(stack, job_id)
