"""Fine-tuning job helpers shared by the API (which creates and cancels jobs) and the worker (which runs them).

A job row is committed in ``queued`` before its message is sent: a worker that receives the message
must find the row. Cancelling a queued job ends it at once; a running one is flagged and its worker
stops after the current step. Status changes themselves belong to ``core.job_states``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from sqlmodel import Session, col, select
from sqlmodel.sql.expression import Select, SelectOfScalar

from core.audit import record_deletion
from core.errors import NotFound
from core.ids import now
from core.job_states import JobStatus, check_move, mark_ended
from core.models import Adapter, FineTuneJob, FineTuningCheckpoint, JobEvent
from core.queue import TRAIN_TASK, train_queue


def adapter_id_for_job(job_id: str) -> str:
    """The id of the adapter a job produces: fixed by the job, so every attempt writes the same objects."""
    return "adapter-" + job_id.split("-", 1)[-1]


def job_id_for_adapter(adapter_id: str) -> str:
    """The job that would produce ``adapter_id`` (the inverse of :func:`adapter_id_for_job`); uploaded
    adapters name a job that does not exist."""
    return "ftjob-" + adapter_id.split("-", 1)[-1]


def results_file_id_for_job(job_id: str) -> str:
    """The id of a job's metrics file (``step_metrics.csv``): fixed by the job, like its adapter's id."""
    return "file-" + job_id.split("-", 1)[-1]


def job_id_for_results_file(file_id: str) -> str:
    """The job whose metrics file would be ``file_id`` (the inverse of :func:`results_file_id_for_job`)."""
    return "ftjob-" + file_id.split("-", 1)[-1]


def fine_tuned_model_name(base_model: str, tenant_name: str, suffix: str | None, job_id: str) -> str:
    """``ft:{base}:{tenant}:{suffix}:{job}``, the name clients pass as ``model``."""
    return f"ft:{base_model}:{tenant_name}:{suffix or ''}:{job_id}"


def with_metadata(stmt: SelectOfScalar[FineTuneJob], pairs: dict[str, str] | None) -> SelectOfScalar[FineTuneJob]:
    """``stmt`` narrowed to jobs whose metadata holds every pair (``None``: to jobs without metadata). A JSON
    path comparison, which SQLite (``json_extract``) and PostgreSQL (``->>``) both evaluate in the query."""
    if pairs is None:
        return stmt.where(col(FineTuneJob.user_metadata).is_(None))
    for key, value in pairs.items():
        stmt = stmt.where(col(FineTuneJob.user_metadata)[key].as_string() == value)
    return stmt


def enqueue_job(celery: Celery, job: FineTuneJob, *, countdown: float | None = None) -> None:
    """Send the job to the training queue of its base model. Call only after the row is committed."""
    # The job row, not a Celery result, records the outcome: nothing reads results, so store none.
    celery.send_task(
        TRAIN_TASK, args=[job.id], queue=train_queue(job.base_model), countdown=countdown, ignore_result=True
    )


def record_event(
    session: Session,
    job: FineTuneJob,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
) -> JobEvent:
    """Append an event to the job's log (OpenAI's shape: level, message, type ``message``/``metrics``, data)."""
    event = JobEvent(job_id=job.id, tenant_id=job.tenant_id, level=level, type=type, message=message, data=data)
    session.add(event)
    return event


def lock_job(session: Session, job_id: str) -> FineTuneJob | None:
    """The job row, locked for update until the transaction ends (SQLite locks the whole database)."""
    return session.exec(
        select(FineTuneJob).where(FineTuneJob.id == job_id).with_for_update().execution_options(populate_existing=True)
    ).first()


def end_job(
    session: Session,
    job: FineTuneJob,
    status: str,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
) -> None:
    """End ``job`` ``cancelled`` or ``failed`` with an event saying why (for ``failed``, also the error a
    user reads), and retire its checkpoints: a job that produced no model serves none of its epochs either.
    Their objects go with the orphan sweep. Raises ``IllegalTransition`` when the job already finished."""
    mark_ended(job, status, error=message, code=code, param=param)
    retire_checkpoints(session, job.id, keep=0)
    session.add(job)
    record_event(session, job, message, level="error" if status == JobStatus.FAILED else "info")


def retire_adapter_row(session: Session, adapter: Adapter, *, cause: str, reason: str) -> bool:
    """Mark ``adapter`` deleted (recording it in the audit trail) and give its model name up (a checkpoint's
    name comes back when a resumed job reaches that step again); True when it was live."""
    was_live = adapter.deleted_at is None
    if was_live:
        adapter.deleted_at = now()
        record_deletion(session, adapter, cause=cause, reason=reason)
    if "#retired-" not in adapter.name:
        adapter.name = f"{adapter.name}#retired-{adapter.id}"
    session.add(adapter)
    return was_live


def live_checkpoints(job_id: str) -> Select[tuple[FineTuningCheckpoint, Adapter]]:
    """The job's checkpoints with their adapters, those still live (a tenant may have deleted one)."""
    return (
        select(FineTuningCheckpoint, Adapter)
        .join(Adapter, col(Adapter.id) == FineTuningCheckpoint.adapter_id)
        .where(FineTuningCheckpoint.job_id == job_id, col(Adapter.deleted_at).is_(None))
    )


def retire_checkpoints(session: Session, job_id: str, *, keep: int) -> list[Adapter]:
    """Retire the job's checkpoints but the newest ``keep``; the adapters that were live (their objects are
    the caller's to remove, or the orphan sweep's)."""
    rows = session.exec(
        select(FineTuningCheckpoint)
        .where(FineTuningCheckpoint.job_id == job_id)
        .order_by(col(FineTuningCheckpoint.step_number).desc())
    ).all()
    retired = []
    for row in rows[keep:]:
        adapter = session.get(Adapter, row.adapter_id)
        if adapter is not None and retire_adapter_row(
            session, adapter, cause=f"job:{job_id}", reason="checkpoint_kept_last"
        ):
            retired.append(adapter)
        session.delete(row)
    return retired


def request_cancel(session: Session, job: FineTuneJob) -> FineTuneJob:
    """Cancel a job: a queued one ends ``cancelled`` now, a running one stops after its current step.

    Cancelling an already cancelled job returns it unchanged; a succeeded or failed one raises
    ``IllegalTransition`` (a ``Conflict``) and is left as it was.
    """
    locked = lock_job(session, job.id)
    if locked is None:
        raise NotFound(f"no fine-tuning job {job.id!r}", param="fine_tuning_job_id")
    if locked.status == JobStatus.CANCELLED:
        return locked
    check_move(locked, JobStatus.CANCELLED)
    if not locked.cancel_requested:
        locked.cancel_requested = True
        if locked.status == JobStatus.RUNNING:
            record_event(session, locked, "Cancellation requested; the job stops after its current step")
    if locked.status != JobStatus.RUNNING:
        end_job(session, locked, JobStatus.CANCELLED, "Job cancelled before it started")
    session.add(locked)
    session.flush()
    return locked
