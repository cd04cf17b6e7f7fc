"""The reaper: running jobs whose worker stopped heartbeating are requeued, or failed once out of attempts.

A worker killed with ``kill -9`` (or lost with its machine) leaves its Celery message unacknowledged
until Redis' visibility timeout, which must outlast the longest job: far too long to wait. Heartbeats
in the job row tell sooner. Every worker runs the reaper periodically; each job is reaped in its own
transaction on the locked row, so concurrent reapers cannot requeue a job twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from celery import Celery
from sqlalchemy import or_
from sqlalchemy.engine import Engine
from sqlmodel import select

from core.db import session_scope
from core.descriptor import adapter_prefix
from core.job_states import JobStatus, mark_queued
from core.jobs import adapter_id_for_job, end_job, enqueue_job, lock_job
from core.models import FineTuneJob
from core.storage import ObjectStore
from worker.lifecycle import fail_out_of_attempts, lease_is_live, record_worker_lost
from worker.upload import remove_adapter_objects

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reaped:
    job_id: str
    outcome: str  # requeued | failed | cancelled
    worker_id: str | None


def _reap_one(engine: Engine, celery: Celery, job_id: str, stale_after: float, at: float) -> Reaped | None:
    with session_scope(engine) as session:
        job = lock_job(session, job_id)
        if job is None or job.status != JobStatus.RUNNING or lease_is_live(job, stale_after, at):
            return None  # finished, or it heartbeated since we looked
        lost = job.worker_id or "an unknown worker"
        if job.cancel_requested:
            end_job(session, job, JobStatus.CANCELLED, f"Job cancelled; its worker {lost} had stopped")
            return Reaped(job.id, "cancelled", job.worker_id)
        if job.attempts >= job.max_attempts:
            fail_out_of_attempts(session, job)
            return Reaped(job.id, "failed", job.worker_id)
        worker_id = job.worker_id
        record_worker_lost(session, job)
        mark_queued(job)
        session.add(job)
        session.flush()
        # Sent before commit: if sending fails the job stays running and stale, and the next pass retries.
        enqueue_job(celery, job)
        return Reaped(job.id, "requeued", worker_id)


def reap_stale_jobs(
    engine: Engine,
    celery: Celery,
    *,
    stale_after: float,
    store: ObjectStore | None = None,
    at: float | None = None,
) -> list[Reaped]:
    """Requeue every ``running`` job without a heartbeat for ``stale_after`` seconds (fail it past its
    ``max_attempts``; end it ``cancelled`` if a cancel was pending). With ``store``, a job that ends also
    loses any adapter objects its dead attempt left."""
    at = time.time() if at is None else at
    with session_scope(engine) as session:
        candidates = session.exec(
            select(FineTuneJob.id).where(
                FineTuneJob.status == JobStatus.RUNNING,
                or_(FineTuneJob.heartbeat_at.is_(None), FineTuneJob.heartbeat_at < at - stale_after),
            )
        ).all()
    reaped = []
    for job_id in candidates:
        result = _reap_one(engine, celery, job_id, stale_after, at)
        if result is None:
            continue
        log.warning("reaped job %s (worker %s): %s", result.job_id, result.worker_id, result.outcome)
        if store is not None and result.outcome != "requeued":
            with session_scope(engine) as session:
                job = session.get(FineTuneJob, job_id)
            if job is not None:
                remove_adapter_objects(store, adapter_prefix(job.tenant_id, adapter_id_for_job(job.id)))
        reaped.append(result)
    return reaped


class ReaperThread(threading.Thread):
    """Calls ``reap`` now and then every ``every`` seconds until stopped; errors are logged, never fatal."""

    def __init__(self, reap: Callable[[], object], every: float) -> None:
        super().__init__(name="loraplex-reaper", daemon=True)
        self._reap = reap
        self._every = every
        self._stopped = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self._reap()
            except Exception:
                log.exception("reaper pass failed; trying again in %.0fs", self._every)
            if self._stopped.wait(self._every):
                return

    def stop(self) -> None:
        self._stopped.set()
