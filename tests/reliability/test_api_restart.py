"""The API process restarts: everything a tenant had (keys, files, jobs with their queue messages and
events, adapters, usage, rate-limit state) is still there, because none of it lived in the process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from api.app import create_app
from core.local_services import EmbeddedRedis
from core.queue import make_celery, train_queue, waiting_job_ids
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api.live_server import serve
from tests.integration.api.peft_adapters import adapter_files
from tests.integration.api_inference.deployment import Deployment, deploy
from tests.reliability.stack import TINY_JOB
from tests.services import S3Service


@pytest.fixture
def stack(
    tmp_path: Path, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Deployment]:
    deployment = deploy(tmp_path, redis_service.url, s3_service, tiny_model_dir)
    yield deployment
    deployment.stop()


def test_a_restarted_api_serves_everything_it_had(stack: Deployment, peft_adapter_dir: Path) -> None:
    tenant = stack.make_tenant(requests_per_minute=1)  # one request, then a minute's wait
    prompt = {"model": stack.base_model, "prompt": "hi", "max_tokens": 2}
    data = chat_jsonl()
    with tenant.http() as http:
        file_id = http.post("/v1/files", files={"file": ("t.jsonl", data)}, data={"purpose": "fine-tune"}).json()["id"]
        body = {"model": stack.base_model, "training_file": file_id, "hyperparameters": TINY_JOB}
        job_id = http.post("/v1/fine_tuning/jobs", json=body).json()["id"]
        adapter = http.post("/v1/adapters", files=adapter_files(peft_adapter_dir)).json()
        assert http.post("/v1/completions", json=prompt).json()["error"]["code"] == "no_replica"  # admitted
        reads = ["/v1/files", f"/v1/fine_tuning/jobs/{job_id}", f"/v1/fine_tuning/jobs/{job_id}/events", "/v1/models"]
        before = {path: http.get(path).json() for path in reads}
    with stack.admin() as admin:
        tenants_before = admin.get("/admin/tenants", params={"limit": 100}).json()

    stack.api.stop()
    stack.api = serve(create_app(stack.settings))  # a new process would find the same: nothing is in memory
    tenant.base_url = stack.api.url

    with tenant.http() as http:
        assert {path: http.get(path).json() for path in reads} == before
        assert http.get(f"/v1/files/{file_id}/content").content == data
        assert http.get(f"/v1/adapters/{adapter['id']}").json() == adapter
        assert http.post("/v1/completions", json=prompt).status_code == 429  # its allowance was not reset
    with stack.admin() as admin:
        assert admin.get("/admin/tenants", params={"limit": 100}).json() == tenants_before
    celery = make_celery(stack.settings)
    assert waiting_job_ids(celery, train_queue(stack.base_model)) == {job_id}  # still on its way to a worker
    celery.close()
