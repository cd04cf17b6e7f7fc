"""A worker killed with SIGKILL in mid-training: the next worker finishes the job, exactly once."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from sqlmodel import select

from core.descriptor import ADAPTER_MANIFEST
from core.local_services import ManagedProcess
from core.models import Adapter, JobStatus, UsageRecord
from tests.integration.conftest import Platform
from tests.integration.training.jobs import MEMORISE, adapter_objects, jsonl, memorable_rows, submit_job, train_losses

pytestmark = pytest.mark.slow


def test_a_job_survives_its_worker_being_killed_and_completes_exactly_once(
    platform: Platform, start_worker: Callable[..., ManagedProcess]
) -> None:
    first = start_worker(platform.settings)
    job = submit_job(platform, "sturdy", jsonl(memorable_rows(seed=7)), hyperparameters={**MEMORISE, "n_epochs": 60})
    platform.wait_until(lambda: len(train_losses(platform.events(job.id))) >= 10, "10 steps", worker=first)

    first.kill()
    assert platform.job(job.id).status == JobStatus.RUNNING  # nothing ran to tell the database
    second = start_worker(platform.settings)

    job = platform.wait_for_job(job.id, timeout=300, worker=second)
    assert job.status == JobStatus.SUCCEEDED, (job.error_code, job.error_message)
    assert job.attempts == 2
    messages = [e.message for e in platform.events(job.id)]
    assert any("stopped responding during attempt 1; the job was requeued" in m for m in messages)
    assert "Fine-tuning job started (attempt 2 of 3)" in messages
    assert messages.count("The job has successfully completed") == 1

    with platform.session() as session:
        adapters = session.exec(select(Adapter).where(Adapter.tenant_id == job.tenant_id)).all()
        usage = session.exec(select(UsageRecord).where(UsageRecord.job_id == job.id)).all()
    assert [a.id for a in adapters] == [job.adapter_id]
    assert len(usage) == 1
    objects = adapter_objects(platform, job.tenant_id)
    assert len(objects) == 3 and all(o.key.startswith(adapters[0].storage_prefix) for o in objects)
    manifest = json.loads(platform.store.get_bytes(adapters[0].storage_prefix + ADAPTER_MANIFEST))
    assert manifest["files"]["adapter_model.safetensors"]["sha256"] == adapters[0].sha256
