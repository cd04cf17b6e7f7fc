"""A worker's moves of a job (claim, finish, retry, heartbeat). Each is one short transaction on the locked
job row, so two workers (or a worker and the reaper, or the API cancelling) never both move the same job;
``core.job_states`` decides which moves are allowed.

A running job belongs to one attempt, its *lease*: (worker id, attempt number). Every transition made
on behalf of an attempt first checks the lease is still held, so an attempt that was given up on (its
heartbeat went stale and the job was requeued) can never overwrite what its successor did.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

from celery import Celery
from sqlalchemy.engine import Engine
from sqlmodel import Session

from core.db import session_scope
from core.job_states import JobStatus, mark_ended, mark_queued, mark_running, sources
from core.jobs import adapter_id_for_job, end_job, enqueue_job, fine_tuned_model_name, lock_job, record_event
from core.models import Adapter, FineTuneJob, Tenant, UsageRecord
from core.storage import ObjectInfo
from worker.results import adopt_results
from worker.upload import UploadedAdapter

MAX_ATTEMPTS_CODE = "max_attempts_exceeded"
# Outages retried before a job fails: with the default 30 s first delay, about an hour of waiting.
MAX_TRANSIENT_FAILURES = 8
MAX_RETRY_DELAY_S = 15 * 60.0


def current_worker_id() -> str:
    """``host:pid`` of this process: unique among live workers, and checkable on the same host."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _worker_gone(worker_id: str | None) -> bool:
    """True when ``worker_id`` names a process on this host that no longer exists."""
    host, _, pid = (worker_id or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine: only its heartbeat can tell
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def lease_is_live(job: FineTuneJob, stale_after: float, at: float | None = None) -> bool:
    """Whether the worker running ``job`` still shows signs of life."""
    if job.heartbeat_at is None or (at or time.time()) - job.heartbeat_at > stale_after:
        return False
    return not _worker_gone(job.worker_id)


@dataclass(frozen=True)
class Lease:
    """One attempt's hold on a running job."""

    job_id: str
    worker_id: str
    attempt: int
    started: float = field(default_factory=time.monotonic)

    def held_by(self, job: FineTuneJob | None) -> bool:
        return (
            job is not None
            and job.status == JobStatus.RUNNING
            and job.worker_id == self.worker_id
            and job.attempts == self.attempt
        )

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


@dataclass(frozen=True)
class Claim:
    """What a delivery of a job should do: ``run`` (with ``lease``), or nothing more (``outcome`` says why)."""

    outcome: str  # run | finalized | skipped | cancelled | failed
    job: FineTuneJob | None = None
    lease: Lease | None = None
    adapter: Adapter | None = None


def fail_out_of_attempts(session: Session, job: FineTuneJob) -> None:
    """End ``job`` failed because its workers kept dying: the one wording, whoever notices it."""
    last = f"; the last was {job.worker_id}" if job.worker_id else ""
    end_job(
        session,
        job,
        JobStatus.FAILED,
        f"the worker running the job stopped during each of its {job.attempts} attempts (killed, out of memory, "
        f"or lost{last}); it will not be retried. Try a smaller batch_size or max_seq_len, or ask the operator "
        "to check the training workers",
        code=MAX_ATTEMPTS_CODE,
    )


def record_worker_lost(session: Session, job: FineTuneJob) -> None:
    """The event that says the running attempt's worker is gone and the job goes back to the queue."""
    lost = job.worker_id or "an unknown worker"
    message = f"Worker {lost} stopped responding during attempt {job.attempts}; the job was requeued"
    record_event(session, job, message, level="warn")


def _succeed(
    session: Session,
    job: FineTuneJob,
    uploaded: UploadedAdapter,
    compute_seconds: float,
    results: ObjectInfo | None,
) -> Adapter:
    mark_ended(job, JobStatus.SUCCEEDED)
    if results is not None:
        adopt_results(session, job, results)
    tenant = session.get(Tenant, job.tenant_id)
    assert tenant is not None  # jobs reference tenants by foreign key
    name = fine_tuned_model_name(job.base_model, tenant.name, job.suffix, job.id)
    manifest = uploaded.manifest
    adapter = uploaded.adapter_row(adapter_id_for_job(job.id), job, name, "fine_tune")
    session.add(adapter)
    job.fine_tuned_model = name
    job.adapter_id = adapter.id
    job.trained_tokens = int(manifest["trained_tokens"])
    job.compute_seconds = compute_seconds
    session.add(job)
    session.add(
        UsageRecord(
            tenant_id=job.tenant_id,
            kind="training",
            model=name,
            adapter_id=adapter.id,
            job_id=job.id,
            replica=job.worker_id,
            training_tokens=job.trained_tokens,
            compute_seconds=compute_seconds,
            status=JobStatus.SUCCEEDED,
        )
    )
    record_event(session, job, f"New fine-tuned model created: {name}")
    record_event(session, job, "The job has successfully completed")
    session.flush()
    return adapter


def claim_job(
    engine: Engine,
    job_id: str,
    worker_id: str,
    *,
    stale_after: float,
    uploaded: UploadedAdapter | None = None,
    results: ObjectInfo | None = None,
) -> Claim:
    """Decide what this delivery of ``job_id`` does, and take the lease when it should train.

    Idempotent: a terminal job, or one another live worker runs, is left alone; one whose adapter an
    earlier attempt already stored (``uploaded``, with its metrics file ``results``) or recorded just
    finalizes; past ``max_attempts`` it fails.
    """
    with session_scope(engine) as session:
        job = lock_job(session, job_id)
        # Finished, or still validating_files (the API sends it again once queued).
        if job is None or job.status not in sources(JobStatus.RUNNING):
            return Claim("skipped", job)
        if job.status == JobStatus.RUNNING and lease_is_live(job, stale_after):
            return Claim("skipped", job)  # a duplicate delivery: its owner is alive
        recorded = session.get(Adapter, adapter_id_for_job(job.id))
        if recorded is not None:
            mark_ended(job, JobStatus.SUCCEEDED)
            job.adapter_id, job.fine_tuned_model = recorded.id, recorded.name
            session.add(job)
            return Claim("finalized", job, adapter=recorded)
        if job.cancel_requested:
            end_job(session, job, JobStatus.CANCELLED, "Job cancelled before training started")
            return Claim("cancelled", job)
        if uploaded is not None:
            adapter = _succeed(session, job, uploaded, float(uploaded.manifest.get("seconds") or 0.0), results)
            return Claim("finalized", job, adapter=adapter)
        if job.attempts >= job.max_attempts:
            fail_out_of_attempts(session, job)
            return Claim("failed", job)
        if job.status == JobStatus.RUNNING:
            # Its worker died and a copy of its message got here before the reaper did: say so, as it would.
            record_worker_lost(session, job)
        mark_running(job, worker_id)
        session.add(job)
        suffix = f" (attempt {job.attempts} of {job.max_attempts})" if job.attempts > 1 else ""
        record_event(session, job, "Fine-tuning job started" + suffix)
        return Claim("run", job, lease=Lease(job.id, worker_id, job.attempts))


def finish_succeeded(
    engine: Engine, lease: Lease, uploaded: UploadedAdapter, results: ObjectInfo | None
) -> tuple[str, Adapter | None]:
    """Record the adapter and the metrics file and mark the job succeeded, in one transaction;
    ``("succeeded", adapter)``, ``("cancelled", None)`` when a cancel arrived during upload, or ``("lost", None)``."""
    with session_scope(engine) as session:
        job = lock_job(session, lease.job_id)
        if job is None or not lease.held_by(job):
            return "lost", None
        if job.cancel_requested:
            end_job(session, job, JobStatus.CANCELLED, "Job cancelled after training; the adapter was discarded")
            return "cancelled", None
        return "succeeded", _succeed(session, job, uploaded, lease.seconds, results)


def finish_ended(
    engine: Engine, lease: Lease, status: str, message: str, *, code: str | None = None, param: str | None = None
) -> bool:
    """End the leased job ``cancelled`` or ``failed``; False when the lease was lost meanwhile."""
    with session_scope(engine) as session:
        job = lock_job(session, lease.job_id)
        if not lease.held_by(job):
            return False
        assert job is not None
        job.compute_seconds = lease.seconds
        end_job(session, job, status, message, code=code, param=param)
        return True


def retry_delay(base: float, failures: int) -> float:
    """Seconds to wait before retrying after the ``failures``-th outage in a row: doubling from ``base``."""
    return min(base * 2 ** max(failures - 1, 0), MAX_RETRY_DELAY_S)


def retry_or_fail(engine: Engine, lease: Lease, celery: Celery, message: str, *, code: str, delay: float) -> str:
    """After a transient failure (a platform service was down): requeue the job, waiting longer after each
    outage, until ``MAX_TRANSIENT_FAILURES``; then fail it. ``delay`` is the first wait.

    An outage is not the job's fault, so the attempt is given back: ``max_attempts`` keeps counting only
    attempts whose worker died. Returns ``"requeued"``, ``"failed"`` or ``"lost"``. The message is sent
    inside the transaction, so either the job is queued with a message on its way or nothing changed (a
    stale lease the reaper finds).
    """
    with session_scope(engine) as session:
        job = lock_job(session, lease.job_id)
        if not lease.held_by(job):
            return "lost"
        assert job is not None
        if job.transient_failures >= MAX_TRANSIENT_FAILURES:
            outages = job.transient_failures + 1
            end_job(session, job, JobStatus.FAILED, f"{message}; gave up after {outages} tries", code=code)
            return "failed"
        job.transient_failures += 1
        job.attempts -= 1
        wait = retry_delay(delay, job.transient_failures)
        mark_queued(job, delay=wait)
        session.add(job)
        record_event(session, job, f"Training was interrupted: {message}; retrying in {wait:.0f}s", level="warn")
        session.flush()
        enqueue_job(celery, job, countdown=wait)
        return "requeued"


def heartbeat(engine: Engine, lease: Lease) -> bool:
    """Refresh the lease's heartbeat; False when the job is no longer this attempt's."""
    with session_scope(engine) as session:
        job = lock_job(session, lease.job_id)
        if not lease.held_by(job):
            return False
        assert job is not None
        job.heartbeat_at = time.time()
        job.compute_seconds = lease.seconds
        session.add(job)
        return True


def read_lease(engine: Engine, lease: Lease) -> tuple[bool, bool]:
    """(lease still held, cancel requested) for a running attempt."""
    with session_scope(engine) as session:
        job = session.get(FineTuneJob, lease.job_id, populate_existing=True)
        return lease.held_by(job), bool(job and job.cancel_requested)
