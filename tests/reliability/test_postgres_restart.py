"""PostgreSQL goes away (every connection cut, new ones refused, as during a restart) and comes back. A stream
being served finishes, requests meanwhile get a retryable 503, and the stream's usage row is stored once the
database answers again (``api/usage/backlog.py``), with what the client was told; a job training meanwhile
finishes exactly once.

Runs when ``LORAPLEX_TEST_POSTGRES_URL`` is set, on a database of its own that it closes and reopens.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from core.local_services import EmbeddedRedis
from tests.integration.api.datasets import chat_jsonl
from tests.integration.api_inference.deployment import Deployment, deploy
from tests.postgres import throwaway_database
from tests.reliability.stack import (
    TINY_JOB,
    assert_retryable_outage,
    assert_succeeded_once,
    job_ended,
    job_events,
    worker_on,
)
from tests.services import S3Service

pytestmark = pytest.mark.slow

Switch = Callable[[bool], None]
UPLOAD = {"purpose": "fine-tune"}
OUTAGE_S = 6.0


@pytest.fixture
def database() -> Iterator[tuple[str, Switch]]:
    """A fresh database, and a switch that cuts and refuses its connections (False) or lets them in (True)."""
    with throwaway_database("loraplex_restart") as database:

        def available(on: bool) -> None:
            with database.admin.connect() as conn:
                allow = "true" if on else "false"
                conn.execute(text(f'ALTER DATABASE "{database.name}" ALLOW_CONNECTIONS {allow}'))
                if not on:
                    terminate = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"
                    conn.execute(text(terminate), {"n": database.name})

        try:
            yield database.url, available
        finally:
            available(True)


@pytest.fixture
def stack(
    tmp_path: Path,
    database: tuple[str, Switch],
    redis_service: EmbeddedRedis,
    s3_service: S3Service,
    tiny_model_dir: Path,
) -> Iterator[Deployment]:
    deployment = deploy(tmp_path, redis_service.url, s3_service, tiny_model_dir, database_url=database[0])
    try:
        deployment.start_replicas(tiny_model_dir, [f"pg-{uuid.uuid4().hex[:6]}"], tmp_path)
        yield deployment
    finally:
        deployment.stop()


def test_a_stream_served_across_a_database_restart_is_still_metered(
    stack: Deployment, database: tuple[str, Switch]
) -> None:
    _, available = database
    tenant = stack.make_tenant()
    body = {
        "model": stack.base_model,
        "prompt": "Keep talking",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    with tenant.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert any(line.startswith("data: {") for line in lines)  # the stream has started
        available(False)  # the database "restarts" under it
        try:
            during = http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
            assert_retryable_outage(during, "service_unavailable")  # its key cannot be checked meanwhile
            for line in lines:
                if line.startswith("data: {") and '"usage":{' in line:
                    usage = json.loads(line.removeprefix("data: "))["usage"]
        finally:
            available(True)
    assert usage is not None and usage["completion_tokens"] == 300

    [record] = stack.wait_until(lambda: stack.usage_records(tenant.id), "the waiting usage row to be stored")
    assert (record.prompt_tokens, record.completion_tokens, record.status) == (
        usage["prompt_tokens"],
        300,
        "completed",
    )


def test_a_job_training_across_a_database_restart_finishes_once(
    stack: Deployment, database: tuple[str, Switch], tmp_path: Path
) -> None:
    _, available = database
    tenant = stack.make_tenant()
    with tenant.http() as http:
        file_id = http.post("/v1/files", files={"file": ("t.jsonl", chat_jsonl(24))}, data=UPLOAD).json()["id"]
        body = {"model": stack.base_model, "training_file": file_id, "hyperparameters": {**TINY_JOB, "n_epochs": 6}}
        job_id = http.post("/v1/fine_tuning/jobs", json=body).json()["id"]
    with worker_on(stack, tmp_path / "worker.log"):
        stepping = lambda: any("Step " in e for e in job_events(stack, job_id))  # noqa: E731
        stack.wait_until(stepping, "the job to train", timeout=120)
        available(False)
        time.sleep(OUTAGE_S)  # heartbeats, progress events and a checkpoint meet the closed database
        available(True)
        stack.wait_until(lambda: job_ended(stack, job_id), "the job to end", timeout=300)

    assert_succeeded_once(stack, job_id)
