"""Job lifecycle rules on the real database, S3 and Redis, driven in-process: redelivery, cancel, reaper."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlmodel import select

from core.descriptor import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_prefix
from core.errors import Conflict
from core.hyperparameters import Hyperparameters
from core.jobs import adapter_id_for_job, request_cancel
from core.models import Adapter, FineTuneJob, FineTuningCheckpoint, JobStatus
from core.queue import train_queue
from tests.integration.conftest import Platform
from tests.integration.training.jobs import adapter_objects, jsonl, memorable_rows, submit_job
from trainer.progress import Checkpoint
from trainer.train import TrainingRequest, train_adapter
from worker.checkpoints import save_checkpoint
from worker.lifecycle import Lease, claim_job, finish_ended, finish_succeeded, retry_or_fail
from worker.reaper import reap_stale_jobs
from worker.requeue import fail_interrupted_submissions, requeue_lost_jobs
from worker.run_job import run_train_job
from worker.runtime import WorkerOptions, WorkerRuntime
from worker.upload import UploadedAdapter, upload_adapter

STALE_AFTER = 30.0


@pytest.fixture
def runtime(platform: Platform) -> Iterator[WorkerRuntime]:
    """A worker's per-process state, to run deliveries in this process."""
    yield WorkerRuntime(platform.settings, platform.celery, WorkerOptions(stale_after_seconds=STALE_AFTER))


def set_job(platform: Platform, job_id: str, **fields: object) -> FineTuneJob:
    with platform.session() as session:
        job = session.get(FineTuneJob, job_id)
        assert job is not None
        for name, value in fields.items():
            setattr(job, name, value)
        session.add(job)
    return platform.job(job_id)


def snapshot(platform: Platform, job_id: str) -> tuple[dict, int]:
    """The job row and how many events it has: what a refused move must leave as it was."""
    return platform.job(job_id).model_dump(), len(platform.events(job_id))


def queued_messages(platform: Platform) -> int:
    client = redis.Redis.from_url(platform.settings.redis_url or "")
    with client:
        return int(client.llen(train_queue(platform.settings.model_name or "")))


def test_a_redelivered_terminal_job_is_left_alone(platform: Platform, runtime: WorkerRuntime) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job(platform, job.id, status=JobStatus.FAILED, error_code="x")
    before = len(platform.events(job.id))

    assert run_train_job(runtime, job.id) == "skipped"
    assert platform.job(job.id).status == JobStatus.FAILED
    assert len(platform.events(job.id)) == before


def test_cancelling_a_queued_job_ends_it_and_its_delivery_does_nothing(
    platform: Platform, runtime: WorkerRuntime
) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    with platform.session() as session:
        cancelled = request_cancel(session, job)
    assert (cancelled.status, cancelled.cancel_requested) == (JobStatus.CANCELLED, True)
    assert cancelled.finished_at is not None

    assert run_train_job(runtime, job.id) == "skipped"
    job = platform.job(job.id)
    assert (job.status, job.attempts) == (JobStatus.CANCELLED, 0)
    with platform.session() as session:
        assert request_cancel(session, job).status == JobStatus.CANCELLED  # again: unchanged, no error


@pytest.mark.parametrize("status", [JobStatus.SUCCEEDED, JobStatus.FAILED])
def test_a_finished_job_cannot_be_cancelled(platform: Platform, status: str) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    job = set_job(platform, job.id, status=status, finished_at=123)
    before = snapshot(platform, job.id)

    with pytest.raises(Conflict, match=f"already {status}"), platform.session() as session:
        request_cancel(session, job)

    assert snapshot(platform, job.id) == before


def test_a_running_job_is_only_flagged_for_its_worker(platform: Platform) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    job = set_job(platform, job.id, status=JobStatus.RUNNING, attempts=1, worker_id="elsewhere:1")
    with platform.session() as session:
        flagged = request_cancel(session, job)
    assert (flagged.status, flagged.cancel_requested) == (JobStatus.RUNNING, True)
    assert "Cancellation requested" in platform.events(job.id)[-1].message


def test_a_redelivered_job_whose_adapter_is_already_stored_just_finalizes(
    platform: Platform, runtime: WorkerRuntime, tiny_model_dir: Path, tmp_path: Path
) -> None:
    rows = memorable_rows(0, n=10)
    job = submit_job(platform, "acme", jsonl(rows), suffix="again", enqueue=False)
    # An earlier attempt trained and uploaded, then its worker died before recording anything.
    data = tmp_path / "train.jsonl"
    data.write_bytes(jsonl(rows))
    hp = Hyperparameters(n_epochs=1, batch_size=5).resolve(max_lora_rank=64)
    result = train_adapter(TrainingRequest(tiny_model_dir, data, tmp_path / "adapter", hp))
    prefix = adapter_prefix(job.tenant_id, adapter_id_for_job(job.id))
    upload_adapter(platform.store, result.output_dir, prefix)
    set_job(platform, job.id, status=JobStatus.RUNNING, attempts=1, worker_id="gone:1", heartbeat_at=1.0)

    assert run_train_job(runtime, job.id) == "finalized"

    job = platform.job(job.id)
    assert (job.status, job.attempts, job.trained_tokens) == (JobStatus.SUCCEEDED, 1, result.trained_tokens)
    assert "Fine-tuning job started" not in [e.message for e in platform.events(job.id)]
    with platform.session() as session:
        [adapter] = session.exec(select(Adapter).where(Adapter.job_id == job.id)).all()
    assert (
        adapter.name == job.fine_tuned_model
        and adapter.sha256 == result.manifest["files"]["adapter_model.safetensors"]["sha256"]
    )
    assert len(adapter_objects(platform, job.tenant_id)) == 3
    assert run_train_job(runtime, job.id) == "skipped"  # and once more: nothing changes


def test_a_duplicate_delivery_leaves_a_live_job_to_its_worker(platform: Platform, runtime: WorkerRuntime) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job(platform, job.id, status=JobStatus.RUNNING, attempts=1, worker_id="otherhost:1", heartbeat_at=time.time())

    assert run_train_job(runtime, job.id) == "skipped"
    job = platform.job(job.id)
    assert (job.status, job.attempts, job.worker_id) == (JobStatus.RUNNING, 1, "otherhost:1")


def test_the_reaper_requeues_a_job_whose_worker_went_silent(platform: Platform) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    stale = time.time() - STALE_AFTER - 1
    set_job(platform, job.id, status=JobStatus.RUNNING, attempts=1, worker_id="otherhost:7", heartbeat_at=stale)
    before = queued_messages(platform)

    [reaped] = reap_stale_jobs(platform.engine, platform.celery, stale_after=STALE_AFTER)

    assert (reaped.job_id, reaped.outcome, reaped.worker_id) == (job.id, "requeued", "otherhost:7")
    job = platform.job(job.id)
    assert (job.status, job.worker_id, job.attempts) == (JobStatus.QUEUED, None, 1)
    assert platform.events(job.id)[-1].level == "warn"
    assert queued_messages(platform) == before + 1
    assert reap_stale_jobs(platform.engine, platform.celery, stale_after=STALE_AFTER) == []


def test_the_reaper_leaves_jobs_with_a_fresh_heartbeat_alone(platform: Platform) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job(platform, job.id, status=JobStatus.RUNNING, attempts=1, worker_id="otherhost:7", heartbeat_at=time.time())

    assert reap_stale_jobs(platform.engine, platform.celery, stale_after=STALE_AFTER) == []
    assert platform.job(job.id).status == JobStatus.RUNNING


def test_a_job_that_keeps_killing_its_workers_ends_failed_not_in_a_loop(platform: Platform) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    # Its last allowed attempt died, leaving half an upload behind.
    prefix = adapter_prefix(job.tenant_id, adapter_id_for_job(job.id))
    platform.store.put_bytes(prefix + "adapter_config.json", b"{}")
    set_job(platform, job.id, status=JobStatus.RUNNING, attempts=3, max_attempts=3, worker_id="h:9", heartbeat_at=1.0)
    before = queued_messages(platform)

    [reaped] = reap_stale_jobs(platform.engine, platform.celery, stale_after=STALE_AFTER, store=platform.store)

    assert reaped.outcome == "failed"
    job = platform.job(job.id)
    assert (job.status, job.error_code) == (JobStatus.FAILED, "max_attempts_exceeded")
    assert "will not be retried" in (job.error_message or "")
    assert queued_messages(platform) == before
    assert adapter_objects(platform, job.tenant_id) == []


def test_a_job_whose_parent_model_was_deleted_fails_saying_so_and_is_not_retried(
    platform: Platform, runtime: WorkerRuntime
) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    parent = Adapter(
        id="adapter-parent",
        tenant_id=job.tenant_id,
        name="ft:tiny:acme:first:ftjob-parent",
        base_model=job.base_model,
        storage_prefix=adapter_prefix(job.tenant_id, "adapter-parent"),
        sha256="0" * 64,
        config_sha256="0" * 64,
        rank=8,
        alpha=16.0,
        deleted_at=1,  # the tenant deleted it after the job was accepted
    )
    with platform.session() as session:
        session.add(parent)
    set_job(platform, job.id, parent_model=parent.name, parent_adapter_id=parent.id)

    assert run_train_job(runtime, job.id) == "failed"

    job = platform.job(job.id)
    assert (job.status, job.error_code, job.error_param) == (JobStatus.FAILED, "model_not_found", "model")
    assert f"{parent.name!r} this job continues was deleted" in (job.error_message or "")
    assert job.attempts == 1 and adapter_objects(platform, job.tenant_id) == []


def dead_worker_id() -> str:
    """``host:pid`` of a process on this host that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{socket.gethostname()}:{proc.pid}"


def test_a_delivery_that_finds_the_worker_dead_records_why_before_taking_over(platform: Platform) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    # A second copy of the message arrives before the reaper noticed: the heartbeat is fresh, the process gone.
    dead = dead_worker_id()
    set_job(platform, job.id, status=JobStatus.RUNNING, attempts=1, worker_id=dead, heartbeat_at=time.time())

    claim = claim_job(platform.engine, job.id, "here:1", stale_after=STALE_AFTER)

    assert claim.outcome == "run" and claim.lease is not None and claim.lease.attempt == 2
    messages = [e.message for e in platform.events(job.id)]
    assert messages[-2:] == [
        f"Worker {dead} stopped responding during attempt 1; the job was requeued",
        "Fine-tuning job started (attempt 2 of 3)",
    ]


def test_a_message_a_worker_just_took_is_not_sent_again_until_it_is_stale(platform: Platform) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)))
    set_job(platform, job.id, queued_at=time.time() - STALE_AFTER - 1)  # due long ago, still unclaimed
    queue = train_queue(platform.settings.model_name or "")
    with platform.celery.connection_for_write() as conn, conn.SimpleQueue(queue) as taken:
        delivery = taken.get(timeout=10)  # a worker holds it, unacknowledged, and has not claimed the job yet
        assert queued_messages(platform) == 0

        assert requeue_lost_jobs(platform.engine, platform.celery, job.base_model, stale_after=STALE_AFTER) == []
        assert queued_messages(platform) == 0
        # Once the delivery is older than the staleness window, its worker is taken for dead.
        later = time.time() + STALE_AFTER + 1
        requeued = requeue_lost_jobs(
            platform.engine, platform.celery, job.base_model, stale_after=STALE_AFTER, at=later
        )
        assert requeued == [job.id]
        assert queued_messages(platform) == 1
        delivery.ack()


@pytest.mark.parametrize("status", [JobStatus.VALIDATING_FILES, JobStatus.CANCELLED, JobStatus.SUCCEEDED])
def test_a_worker_starts_only_a_queued_job(platform: Platform, status: str) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job(platform, job.id, status=status)
    before = snapshot(platform, job.id)

    claim = claim_job(platform.engine, job.id, "here:1", stale_after=STALE_AFTER)

    assert (claim.outcome, claim.lease) == ("skipped", None)
    assert snapshot(platform, job.id) == before


def stored_adapter(job: FineTuneJob) -> UploadedAdapter:
    """What an attempt that finished uploading hands to ``finish_succeeded``."""
    files = {name: {"sha256": "0" * 64, "bytes": 10} for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}
    manifest = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj"], "trained_tokens": 99, "files": files}
    return UploadedAdapter(adapter_prefix(job.tenant_id, adapter_id_for_job(job.id)), manifest)


def test_an_attempt_whose_job_was_cancelled_cannot_end_it_otherwise(platform: Platform) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    stale = time.time() - STALE_AFTER - 1
    set_job(
        platform,
        job.id,
        status=JobStatus.RUNNING,
        attempts=1,
        worker_id="slowhost:7",
        heartbeat_at=stale,
        cancel_requested=True,
    )
    # The worker was only slow, but the reaper took it for dead and ended the job as the client asked.
    [reaped] = reap_stale_jobs(platform.engine, platform.celery, stale_after=STALE_AFTER)
    assert reaped.outcome == "cancelled"
    before, messages = snapshot(platform, job.id), queued_messages(platform)
    lease = Lease(job.id, "slowhost:7", 1)

    assert finish_succeeded(platform.engine, lease, stored_adapter(job), None) == ("lost", None)
    assert not finish_ended(platform.engine, lease, JobStatus.FAILED, "out of memory", code="training_error")
    assert retry_or_fail(platform.engine, lease, platform.celery, "store down", code="storage_error", delay=1) == "lost"

    assert snapshot(platform, job.id) == before and before[0]["status"] == JobStatus.CANCELLED
    assert queued_messages(platform) == messages
    with platform.session() as session:
        assert session.exec(select(Adapter).where(Adapter.job_id == job.id)).all() == []


@pytest.mark.parametrize("status", sorted(JobStatus.TERMINAL))
def test_the_reaper_leaves_finished_jobs_alone(platform: Platform, status: str) -> None:
    stale = time.time() - STALE_AFTER - 1
    silent = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job(platform, silent.id, status=JobStatus.RUNNING, attempts=1, worker_id="otherhost:7", heartbeat_at=stale)
    finished = submit_job(platform, "acme", jsonl(memorable_rows(1)), enqueue=False)
    # A finished row that still shows an old worker and heartbeat: nothing may bring it back.
    set_job(platform, finished.id, status=status, attempts=1, worker_id="otherhost:8", heartbeat_at=stale)
    before = snapshot(platform, finished.id)

    reaped = reap_stale_jobs(platform.engine, platform.celery, stale_after=STALE_AFTER)

    assert [(r.job_id, r.outcome) for r in reaped] == [(silent.id, "requeued")]
    assert snapshot(platform, finished.id) == before


@pytest.mark.parametrize("status", [JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.CANCELLED])
def test_only_queued_jobs_are_sent_again(platform: Platform, status: str) -> None:
    long_ago = time.time() - STALE_AFTER - 1
    lost = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job(platform, lost.id, queued_at=long_ago)
    other = submit_job(platform, "acme", jsonl(memorable_rows(1)), enqueue=False)
    set_job(platform, other.id, status=status, queued_at=long_ago, heartbeat_at=time.time())
    before = snapshot(platform, other.id)

    requeued = requeue_lost_jobs(platform.engine, platform.celery, lost.base_model, stale_after=STALE_AFTER)

    assert requeued == [lost.id]
    assert snapshot(platform, other.id) == before
    assert queued_messages(platform) == 1


@pytest.mark.parametrize("status", [JobStatus.QUEUED, JobStatus.CANCELLED])
def test_only_jobs_still_validating_fail_as_interrupted_submissions(platform: Platform, status: str) -> None:
    stuck = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job(platform, stuck.id, status=JobStatus.VALIDATING_FILES)
    other = submit_job(platform, "acme", jsonl(memorable_rows(1)), enqueue=False)
    set_job(platform, other.id, status=status)
    before = snapshot(platform, other.id)
    later = time.time() + 10 * STALE_AFTER

    failed = fail_interrupted_submissions(platform.engine, stuck.base_model, stale_after=STALE_AFTER, at=later)

    assert failed == [stuck.id]
    assert (platform.job(stuck.id).status, platform.job(stuck.id).error_code) == (
        JobStatus.FAILED,
        "submission_interrupted",
    )
    assert snapshot(platform, other.id) == before


def test_a_checkpoint_saved_again_takes_its_name_back_and_an_ended_job_retires_its_checkpoints(
    platform: Platform, tiny_model_dir: Path, tmp_path: Path
) -> None:
    job = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job(platform, job.id, status=JobStatus.RUNNING, attempts=1, worker_id="here:1", heartbeat_at=time.time())
    lease = Lease(job.id, "here:1", 1)
    request = TrainingRequest(
        base_model_dir=tiny_model_dir,
        training_file=tmp_path / "train.jsonl",
        output_dir=tmp_path / "out",
        hyperparameters=Hyperparameters(n_epochs=1, batch_size=4).resolve(max_lora_rank=64),
        base_model_name=platform.settings.model_name,
    )
    request.training_file.write_bytes(jsonl(memorable_rows(0)))
    saved: list[Checkpoint] = []
    copies = tmp_path / "copies"

    def keep(checkpoint: Checkpoint) -> None:
        for part in ("adapter", "state"):
            shutil.copytree(getattr(checkpoint, f"{part}_dir"), copies / part)
        saved.append(checkpoint)

    train_adapter(request, on_checkpoint=keep)
    checkpoint = Checkpoint(saved[0].step, 1, copies / "adapter", copies / "state")
    # The first save's objects went missing, so a restarted attempt trained the epoch again and saves it again.
    assert save_checkpoint(platform.settings, platform.engine, platform.store, lease, checkpoint)
    assert save_checkpoint(platform.settings, platform.engine, platform.store, lease, checkpoint)

    with platform.session() as session:
        rows = session.exec(select(Adapter).where(Adapter.job_id == job.id)).all()
        [kept] = session.exec(select(FineTuningCheckpoint).where(FineTuningCheckpoint.job_id == job.id)).all()
    live = [a for a in rows if a.deleted_at is None]
    assert [a.id for a in live] == [kept.adapter_id] and live[0].name.endswith(f":ckpt-step-{checkpoint.step}")
    [replaced] = [a for a in rows if a.deleted_at is not None]
    assert replaced.name == f"{live[0].name}#retired-{replaced.id}"
    assert platform.store.list(replaced.storage_prefix) == []

    # A job that ends without a model (cancelled or failed) serves none of its epochs either.
    assert finish_ended(platform.engine, lease, JobStatus.CANCELLED, "Job cancelled at step 4")
    with platform.session() as session:
        assert session.exec(select(FineTuningCheckpoint).where(FineTuningCheckpoint.job_id == job.id)).all() == []
        adapters = session.exec(select(Adapter).where(Adapter.job_id == job.id)).all()
    assert adapters and all(a.deleted_at is not None and "#retired-" in a.name for a in adapters)
