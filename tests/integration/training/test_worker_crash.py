"""A worker killed with SIGKILL in mid-training: the next worker resumes the job from its last checkpoint and
finishes it exactly once, with the adapter a run that was never interrupted trains."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlmodel import col, select

from core.descriptor import ADAPTER_MANIFEST, ADAPTER_WEIGHTS
from core.local_services import ManagedProcess
from core.models import Adapter, FineTuneJob, FineTuningCheckpoint, JobEvent, JobStatus, UsageRecord
from tests.integration.conftest import Platform
from tests.integration.training.jobs import (
    MEMORISE,
    adapter_objects,
    download_adapter,
    jsonl,
    memorable_rows,
    submit_job,
    train_losses,
)
from worker.orphans import sweep_orphaned_objects

pytestmark = pytest.mark.slow
EVERY_EPOCH = {"CHECKPOINT_INTERVAL_SECONDS": "0"}  # so that the kill lands after a few checkpoints
STEPS_PER_EPOCH, EPOCHS = 4, 12  # 16 examples in batches of 4
RESUMED = re.compile(r"Training resumed at step (\d+) \(epoch (\d+)\) from its last checkpoint")


def metric_steps(events: list[JobEvent]) -> list[int]:
    return [e.data["step"] for e in events if e.type == "metrics" and e.data and "train_loss" in e.data]


def test_a_job_survives_its_worker_being_killed_and_resumes_from_its_last_checkpoint(
    platform: Platform, start_worker: Callable[..., ManagedProcess], tmp_path: Path
) -> None:
    rows, hyperparameters = jsonl(memorable_rows(seed=7)), {**MEMORISE, "n_epochs": EPOCHS}
    first = start_worker(platform.settings, **EVERY_EPOCH)
    job = submit_job(platform, "sturdy", rows, hyperparameters=hyperparameters)
    platform.wait_until(lambda: len(train_losses(platform.events(job.id))) >= 10, "10 steps", worker=first)

    first.kill()
    assert platform.job(job.id).status == JobStatus.RUNNING  # nothing ran to tell the database
    steps_before = metric_steps(platform.events(job.id))
    second = start_worker(platform.settings, **EVERY_EPOCH)

    job = platform.wait_for_job(job.id, timeout=300, worker=second)
    assert job.status == JobStatus.SUCCEEDED, (job.error_code, job.error_message)
    assert job.attempts == 2
    events = platform.events(job.id)
    messages = [e.message for e in events]
    assert any("stopped responding during attempt 1; the job was requeued" in m for m in messages)
    assert "Fine-tuning job started (attempt 2 of 3)" in messages
    assert messages.count("The job has successfully completed") == 1
    # It went on from its newest checkpoint: the step count continues instead of starting at 1 again.
    resumed = [m for e in events if (m := RESUMED.fullmatch(e.message))]
    assert len(resumed) == 1
    step, epoch = int(resumed[0][1]), int(resumed[0][2])
    assert step == epoch * STEPS_PER_EPOCH and 2 * STEPS_PER_EPOCH <= step <= max(steps_before)
    assert metric_steps(events)[len(steps_before) :] == list(range(step + 1, EPOCHS * STEPS_PER_EPOCH + 1))

    # The last three epochs' checkpoints are kept, each a live adapter; the last one is the final adapter.
    with platform.session() as session:
        checkpoints = session.exec(
            select(FineTuningCheckpoint)
            .where(FineTuningCheckpoint.job_id == job.id)
            .order_by(col(FineTuningCheckpoint.step_number))
        ).all()
        adapters = {a.id: a for a in session.exec(select(Adapter).where(Adapter.tenant_id == job.tenant_id)).all()}
        usage = session.exec(select(UsageRecord).where(UsageRecord.job_id == job.id)).all()
    assert [c.step_number for c in checkpoints] == [40, 44, 48]
    assert [c.epoch for c in checkpoints] == [10, 11, 12]
    live = {a.id for a in adapters.values() if a.deleted_at is None}
    assert live == {job.adapter_id, *(c.adapter_id for c in checkpoints)}
    assert all(adapters[c.adapter_id].source == "checkpoint" for c in checkpoints)
    assert adapters[checkpoints[-1].adapter_id].name == f"{job.fine_tuned_model}:ckpt-step-48"
    assert adapters[checkpoints[-1].adapter_id].sha256 == adapters[job.adapter_id].sha256
    assert len(usage) == 1
    # Every live adapter's objects are stored. Any others are a checkpoint upload (or a retired checkpoint's
    # removal) that the kill cut short: the orphan sweep's to remove, checked below.
    stored = {o.key.split("/")[3] for o in adapter_objects(platform, job.tenant_id)}
    leftover = stored - live
    assert live <= stored
    manifest = json.loads(platform.store.get_bytes(adapters[job.adapter_id].storage_prefix + ADAPTER_MANIFEST))
    assert manifest["files"][ADAPTER_WEIGHTS]["sha256"] == adapters[job.adapter_id].sha256

    # The same job, never interrupted, trains the same adapter.
    reference = submit_job(platform, "steady", rows, hyperparameters=hyperparameters)
    reference = platform.wait_for_job(reference.id, timeout=300, worker=second)
    assert reference.status == JobStatus.SUCCEEDED, (reference.error_code, reference.error_message)
    a, b = _weights(platform, job, tmp_path / "resumed"), _weights(platform, reference, tmp_path / "ref")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)

    removed = sweep_orphaned_objects(platform.engine, platform.store, grace_seconds=60, at=time.time() + 3600)
    assert {key.split("/")[3] for key in removed} == leftover


def _weights(platform: Platform, job: FineTuneJob, dest: Path) -> dict[str, torch.Tensor]:
    assert job.adapter_id is not None
    return load_file(download_adapter(platform, job.tenant_id, job.adapter_id, dest) / ADAPTER_WEIGHTS)
