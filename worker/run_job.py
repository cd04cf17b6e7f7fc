"""One delivery of a training job, start to end: claim, fetch data, train, upload, record.

Safe to run any number of times for the same job: see ``worker.lifecycle.claim_job`` for what a
repeated delivery does. Objects under the job's adapter prefix exist without an ``Adapter`` row only
while an attempt is between upload and its final transaction. An attempt after a crash resumes from the
job's newest checkpoint (``worker.checkpoints``), so the work done before it is not done again.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from core.db import session_scope
from core.descriptor import adapter_prefix
from core.errors import InvalidRequest, NotFound, ObjectNotFound
from core.hyperparameters import ResolvedHyperparameters
from core.jobs import adapter_id_for_job, record_event
from core.models import File, FineTuneJob, JobStatus
from trainer.errors import TrainingCancelled
from trainer.progress import Checkpoint
from worker.announce import announce_prefetch
from worker.checkpoints import fetch_checkpoint, save_checkpoint
from worker.failures import classify_failure
from worker.lease_keeper import LeaseKeeper
from worker.lifecycle import Lease, claim_job, current_worker_id, finish_ended, finish_succeeded, retry_or_fail
from worker.metrics import job_metrics
from worker.parent_adapter import fetch_parent_adapter
from worker.progress_events import ProgressRecorder
from worker.results import find_results, remove_results, upload_results
from worker.runtime import WorkerRuntime
from worker.upload import find_uploaded_adapter, remove_adapter_objects, upload_adapter

if TYPE_CHECKING:
    from trainer.train import TrainingResult

log = logging.getLogger(__name__)


def run_train_job(rt: WorkerRuntime, job_id: str) -> str:
    """Handle one delivery of ``job_id``; returns what happened (``succeeded``, ``skipped``, ...)."""
    with session_scope(rt.engine) as session:
        job = session.get(FineTuneJob, job_id)
    if job is None:
        log.warning("job %s does not exist; dropping its message", job_id)
        return "missing"
    if job.status in JobStatus.TERMINAL:
        return "skipped"
    prefix = adapter_prefix(job.tenant_id, adapter_id_for_job(job.id))
    uploaded = find_uploaded_adapter(rt.store, prefix)
    results = find_results(rt.store, job) if uploaded is not None else None
    stale_after = rt.options.stale_after_seconds
    claim = claim_job(
        rt.engine, job_id, current_worker_id(), stale_after=stale_after, uploaded=uploaded, results=results
    )
    log.info("job %s: %s", job_id, claim.outcome)
    if claim.outcome in ("cancelled", "failed"):
        remove_adapter_objects(rt.store, prefix)
        remove_results(rt.store, job.id, job.tenant_id)
    if claim.outcome == "finalized" and claim.adapter is not None:
        announce_prefetch(rt.settings, claim.adapter)
    if claim.outcome != "run":
        return claim.outcome
    assert claim.job is not None and claim.lease is not None
    started = time.monotonic()
    outcome = _run_attempt(rt, claim.job, claim.lease, prefix)
    job_metrics().attempt_seconds.labels(claim.job.method, outcome).observe(time.monotonic() - started)
    log.info("job %s attempt %d: %s", job_id, claim.lease.attempt, outcome)
    return outcome


def _run_attempt(rt: WorkerRuntime, job: FineTuneJob, lease: Lease, prefix: str) -> str:
    with LeaseKeeper(rt.engine, lease, rt.options.heartbeat_seconds) as keeper:
        try:
            with tempfile.TemporaryDirectory(prefix=f"loraplex-{job.id}-") as scratch:
                result = _train(rt, job, keeper, Path(scratch))
                if keeper.should_stop():  # cancelled (or requeued) while the last step ran
                    raise TrainingCancelled(result.steps)
                results = upload_results(rt.store, job, result.step_metrics_csv)
                uploaded = upload_adapter(rt.store, result.output_dir, prefix)
        except TrainingCancelled as exc:
            if keeper.lost:
                return "lost"
            finish_ended(rt.engine, lease, JobStatus.CANCELLED, f"Job cancelled at step {exc.step}")
            return "cancelled"
        except Exception as exc:
            return _fail(rt, lease, keeper, exc)
        try:
            outcome, adapter = finish_succeeded(rt.engine, lease, uploaded, results)
        except Exception as exc:
            _discard_outputs(rt, job, prefix)
            return _fail(rt, lease, keeper, exc)
    if outcome == "cancelled":
        _discard_outputs(rt, job, prefix)
    if adapter is not None:
        announce_prefetch(rt.settings, adapter)
    return outcome


def _discard_outputs(rt: WorkerRuntime, job: FineTuneJob, prefix: str) -> None:
    remove_adapter_objects(rt.store, prefix)
    remove_results(rt.store, job.id, job.tenant_id)


def _fail(rt: WorkerRuntime, lease: Lease, keeper: LeaseKeeper, exc: Exception) -> str:
    if keeper.lost:
        return "lost"
    failure = classify_failure(exc, lease.job_id)
    job_metrics().failures.labels(failure.code, "true" if failure.retryable else "false").inc()
    if failure.retryable:
        delay = rt.options.retry_delay_seconds
        return retry_or_fail(rt.engine, lease, rt.celery, failure.message, code=failure.code, delay=delay)
    if finish_ended(rt.engine, lease, JobStatus.FAILED, failure.message, code=failure.code, param=failure.param):
        return "failed"
    return "lost"


def _train(rt: WorkerRuntime, job: FineTuneJob, keeper: LeaseKeeper, scratch: Path) -> TrainingResult:
    # Imported here: torch stays out of the worker's parent process and is loaded once per pool process.
    from transformers.utils import logging as transformers_logging

    from trainer.checkpoints import resume_layout
    from trainer.train import TrainingRequest, train_adapter

    transformers_logging.disable_progress_bar()  # bars would land in the worker log as warnings
    if job.base_model != rt.base_model_name:
        raise InvalidRequest(
            f"this worker trains {rt.base_model_name!r}, not {job.base_model!r}",
            param="model",
            code="model_not_available",
        )
    hyperparameters = ResolvedHyperparameters.model_validate(job.hyperparameters)
    training = _download(rt, job, job.training_file, scratch / "training.jsonl", "training_file")
    validation = None
    if job.validation_file:
        validation = _download(rt, job, job.validation_file, scratch / "validation.jsonl", "validation_file")
    parent = fetch_parent_adapter(rt.engine, rt.store, job, scratch / "parent")
    resume_from = None
    stored = fetch_checkpoint(rt.engine, rt.store, job.id, scratch / "checkpoint")
    if stored is not None:
        resume_from = resume_layout(stored.adapter_dir, stored.state_dir, scratch / "resume")
        with session_scope(rt.engine) as session:
            message = f"Training resumed at step {stored.step} (epoch {stored.epoch}) from its last checkpoint"
            record_event(session, job, message, data={"step": stored.step})
    request = TrainingRequest(
        base_model_dir=rt.base_model_dir,
        training_file=training,
        output_dir=scratch / "adapter",
        hyperparameters=hyperparameters,
        seed=job.seed,
        validation_file=validation,
        base_model_name=rt.base_model_name,
        base_fingerprint=rt.fingerprint(),
        num_threads=rt.options.train_threads,
        resume_from=resume_from,
        checkpoint_interval_s=rt.options.checkpoint_interval_seconds,
        method=job.method,
        parent_adapter_dir=parent,
    )

    def on_checkpoint(checkpoint: Checkpoint) -> None:
        if not save_checkpoint(rt.settings, rt.engine, rt.store, keeper.lease, checkpoint):
            keeper.lost = True  # the job is no longer this attempt's: stop training, write nothing more
            raise TrainingCancelled(checkpoint.step)

    return train_adapter(
        request,
        on_progress=ProgressRecorder(rt.engine, job),
        should_cancel=keeper.should_stop,
        on_checkpoint=on_checkpoint,
    )


def _download(rt: WorkerRuntime, job: FineTuneJob, file_id: str, dest: Path, param: str) -> Path:
    with session_scope(rt.engine) as session:
        row = session.get(File, file_id)
    what = param.replace("_", " ")
    gone = NotFound(
        f"the {what} {file_id} no longer exists; upload it again and create a new job",
        param=param,
        code="file_not_found",
    )
    # Another tenant's file reads exactly like a missing one.
    if row is None or row.tenant_id != job.tenant_id or row.deleted_at is not None:
        raise gone
    try:
        rt.store.get_file(row.storage_key, dest, expected_sha256=row.sha256)
    except ObjectNotFound:
        raise gone from None
    return dest
