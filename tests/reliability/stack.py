"""What the fault tests share: what a tenant holds (to compare before and after a fault), a job's rows
and events, a worker for the length of a block, and the shape of a retryable outage answer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from sqlmodel import col, select

from core import db
from core.local_services import ManagedProcess
from core.models import Adapter, FineTuneJob, JobEvent, JobStatus, UsageRecord
from tests.holdings import Holdings
from tests.holdings import holdings as tenant_holdings
from tests.integration.api.conftest import TenantHandle
from tests.integration.api_inference.deployment import Deployment
from tests.integration.conftest import launch_worker

TINY_JOB = {"n_epochs": 1, "batch_size": 4, "lora_r": 4}  # a few seconds of training on the tiny model


def holdings(deployment: Deployment, tenant: TenantHandle) -> Holdings:
    """What ``tenant`` holds now on ``deployment``."""
    return tenant_holdings(deployment.settings, deployment.engine, tenant.id)


def job_row(deployment: Deployment, job_id: str) -> FineTuneJob:
    with db.read_session(deployment.engine) as session:
        job = session.get(FineTuneJob, job_id)
    assert job is not None, f"no job {job_id}"
    return job


def job_ended(deployment: Deployment, job_id: str) -> bool:
    return job_row(deployment, job_id).status in JobStatus.TERMINAL


def job_events(deployment: Deployment, job_id: str) -> list[str]:
    """The job's event messages, oldest first."""
    with db.read_session(deployment.engine) as session:
        stmt = select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(col(JobEvent.id))
        return list(session.exec(stmt).all())


def training_records(deployment: Deployment, job_id: str) -> list[UsageRecord]:
    with db.read_session(deployment.engine) as session:
        stmt = select(UsageRecord).where(UsageRecord.job_id == job_id, UsageRecord.kind == "training")
        return list(session.exec(stmt).all())


def job_adapters(deployment: Deployment, job_id: str) -> list[Adapter]:
    """The adapters a job produced as its result (its epoch checkpoints apart)."""
    with db.read_session(deployment.engine) as session:
        stmt = select(Adapter).where(Adapter.job_id == job_id, Adapter.source == "fine_tune")
        return list(session.exec(stmt).all())


@contextmanager
def worker_on(deployment: Deployment, log_path: Path) -> Iterator[ManagedProcess]:
    """A worker for ``deployment`` while the block runs: the deployment's waits watch it, and it stops after."""
    worker = launch_worker(deployment.settings, log_path)
    deployment.processes.append(worker)
    try:
        yield worker
    finally:
        worker.stop()
        deployment.processes.remove(worker)


def assert_succeeded_once(deployment: Deployment, job_id: str) -> tuple[FineTuneJob, Adapter]:
    """The job succeeded, said so once, and left one adapter and one training record; its row and adapter."""
    job = job_row(deployment, job_id)
    events = job_events(deployment, job_id)
    assert job.status == JobStatus.SUCCEEDED, (job.error_message, events)
    assert events.count("The job has successfully completed") == 1
    [adapter] = job_adapters(deployment, job_id)
    assert len(training_records(deployment, job_id)) == 1
    return job, adapter


def assert_retryable_outage(response: httpx.Response, code: str) -> None:
    """A 503 the openai SDK retries by itself: the error shape, our code, and a ``retry-after``."""
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert int(response.headers["retry-after"]) >= 1
