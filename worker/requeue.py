"""Jobs whose queue message was lost: published again, so they still run.

A Redis without persistence forgets every waiting message when it restarts, and a job row can be left
``queued`` without a message (an API that stopped between committing the row and publishing it, or a
worker killed while holding a delayed retry). Workers look for ``queued`` jobs of their base model whose
message is due since ``stale_after`` seconds yet neither waits in the queue nor went to a worker in the
last ``stale_after`` seconds, and send it again. A job that is delivered twice runs once
(``worker.lifecycle.claim_job`` is idempotent), so sending again is safe; each job is republished in its
own transaction on the locked row, so concurrent workers send it once. Jobs stuck in ``validating_files``
(the API stopped mid-submission, so its client never got the job) are failed with a message saying to
create them again.
"""

from __future__ import annotations

import logging
import time

from celery import Celery
from sqlalchemy import or_
from sqlalchemy.engine import Engine
from sqlmodel import col, select

from core.db import read_session, session_scope
from core.job_states import JobStatus, mark_queued
from core.jobs import end_job, enqueue_job, lock_job, record_event
from core.models import FineTuneJob
from core.queue import in_flight_job_ids, train_queue, waiting_job_ids

log = logging.getLogger(__name__)

SUBMISSION_INTERRUPTED_CODE = "submission_interrupted"


def requeue_lost_jobs(
    engine: Engine, celery: Celery, base_model: str, *, stale_after: float, at: float | None = None
) -> list[str]:
    """Publish again the ``queued`` jobs of ``base_model`` whose message is missing; their ids."""
    at = time.time() if at is None else at
    with read_session(engine) as session:
        due = session.exec(
            select(FineTuneJob.id).where(
                FineTuneJob.status == JobStatus.QUEUED,
                FineTuneJob.base_model == base_model,
                or_(col(FineTuneJob.queued_at).is_(None), col(FineTuneJob.queued_at) < at - stale_after),
            )
        ).all()
    if not due:
        return []
    queue = train_queue(base_model)
    # A message a worker took moments ago is on its way to being claimed, not lost: sending it again
    # would leave a second message that a later worker takes over the job with.
    present = waiting_job_ids(celery, queue) | in_flight_job_ids(celery, queue, delivered_since=at - stale_after)
    requeued = [job_id for job_id in due if job_id not in present and _requeue(engine, celery, job_id, stale_after, at)]
    for job_id in requeued:
        log.warning("job %s was queued without a message (Redis restarted?); sent it again", job_id)
    return requeued


def _requeue(engine: Engine, celery: Celery, job_id: str, stale_after: float, at: float) -> bool:
    with session_scope(engine) as session:
        job = lock_job(session, job_id)
        # Another worker may have sent it, or a worker claimed it, since we looked.
        if job is None or job.status != JobStatus.QUEUED or (job.queued_at or 0.0) >= at - stale_after:
            return False
        mark_queued(job)
        session.add(job)
        record_event(session, job, "The job's place in the queue was lost (the queue restarted); queued it again")
        session.flush()
        enqueue_job(celery, job)  # before commit: if sending fails, nothing changed and the next pass retries
        return True


def fail_interrupted_submissions(
    engine: Engine, base_model: str, *, stale_after: float, at: float | None = None
) -> list[str]:
    """Fail jobs of ``base_model`` left in ``validating_files`` for ``stale_after`` seconds; their ids."""
    at = time.time() if at is None else at
    with read_session(engine) as session:
        stuck = session.exec(
            select(FineTuneJob.id).where(
                FineTuneJob.status == JobStatus.VALIDATING_FILES,
                FineTuneJob.base_model == base_model,
                FineTuneJob.created_at < at - stale_after,
            )
        ).all()
    failed = []
    for job_id in stuck:
        with session_scope(engine) as session:
            job = lock_job(session, job_id)
            if job is None or job.status != JobStatus.VALIDATING_FILES:
                continue
            message = "the job's submission was interrupted before it was queued; create the job again"
            end_job(session, job, JobStatus.FAILED, message, code=SUBMISSION_INTERRUPTED_CODE)
            failed.append(job_id)
    return failed
