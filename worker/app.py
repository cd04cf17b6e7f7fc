"""The training worker's Celery app: the shared queue config plus the ``train_job`` task and the reaper
(which also requeues jobs whose queue message was lost)."""

from __future__ import annotations

import logging
import time

from celery import Celery
from celery.signals import worker_process_init

from core.queue import TRAIN_TASK, make_celery
from core.settings import Settings
from worker.orphans import sweep_orphaned_objects
from worker.reaper import ReaperThread, reap_stale_jobs
from worker.requeue import fail_interrupted_submissions, requeue_lost_jobs
from worker.run_job import run_train_job
from worker.runtime import WorkerOptions, WorkerRuntime

log = logging.getLogger(__name__)


def create_worker_app(settings: Settings, options: WorkerOptions | None = None) -> Celery:
    """A Celery app with ``train_job`` registered under ``TRAIN_TASK``; each pool process also runs a reaper."""
    celery = make_celery(settings)
    runtime = WorkerRuntime(settings, celery, options or WorkerOptions())

    @celery.task(name=TRAIN_TASK, ignore_result=True)
    def train_job(job_id: str) -> str:
        """Run fine-tuning job ``job_id`` (idempotent: re-deliveries finalize or do nothing)."""
        return run_train_job(runtime, job_id)

    last_sweep = [float("-inf")]

    def reap() -> None:
        # One pass of upkeep: running jobs whose worker went silent, queued jobs whose message was lost,
        # submissions the API never finished, and now and then objects nothing refers to. Each step is
        # idempotent and safe beside other workers.
        options = runtime.options
        stale_after = options.stale_after_seconds
        reap_stale_jobs(runtime.engine, celery, stale_after=stale_after, store=runtime.store)
        requeue_lost_jobs(runtime.engine, celery, runtime.base_model_name, stale_after=stale_after)
        fail_interrupted_submissions(runtime.engine, runtime.base_model_name, stale_after=stale_after)
        if time.monotonic() - last_sweep[0] >= options.orphan_grace_seconds / 4:
            # Listing the whole store is the costly step: run it a few times per grace period.
            sweep_orphaned_objects(runtime.engine, runtime.store, grace_seconds=options.orphan_grace_seconds)
            last_sweep[0] = time.monotonic()

    def start_pool_process(**_: object) -> None:
        # Runs in each forked pool process: drop the parent's connections, start this process's reaper
        # (threads are started after the fork, never before it).
        runtime.after_fork()
        ReaperThread(reap, runtime.options.reap_every_seconds).start()

    worker_process_init.connect(start_pool_process, weak=False)
    return celery
