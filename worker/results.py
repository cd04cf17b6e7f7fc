"""A job's result file: its step metrics as CSV (``step_metrics.csv``, as OpenAI names it), which the tenant
reads through ``/v1/files/{id}/content``.

Like the adapter, it is stored before the transaction that records the job succeeded, and under an id fixed
by the job, so that transaction (or a redelivery's, after a crash in between) adopts it with a ``File`` row;
a job that ends otherwise removes it, and the orphan sweep removes what a crash leaves.
"""

from __future__ import annotations

import logging

from sqlmodel import Session

from core.descriptor import file_key
from core.errors import ObjectNotFound
from core.jobs import results_file_id_for_job
from core.models import File, FineTuneJob
from core.storage import ObjectInfo, ObjectStore
from trainer.metrics import STEP_METRICS_FILE

log = logging.getLogger(__name__)
RESULTS_PURPOSE = "fine-tune-results"  # OpenAI's purpose for a job's result files


def results_key(job: FineTuneJob) -> str:
    return file_key(job.tenant_id, results_file_id_for_job(job.id))


def upload_results(store: ObjectStore, job: FineTuneJob, csv_text: str) -> ObjectInfo:
    """Store the job's metrics CSV under its fixed key (replacing an earlier attempt's)."""
    return store.put_bytes(results_key(job), csv_text.encode(), "text/csv")


def find_results(store: ObjectStore, job: FineTuneJob) -> ObjectInfo | None:
    """The metrics CSV an earlier attempt stored, or None."""
    try:
        return store.stat(results_key(job))
    except ObjectNotFound:
        return None


def remove_results(store: ObjectStore, job_id: str, tenant_id: str) -> None:
    """Best-effort removal (logged, never raised: the job is already ending otherwise)."""
    key = file_key(tenant_id, results_file_id_for_job(job_id))
    try:
        store.delete(key)
    except Exception:
        log.exception("could not remove %s; the orphan sweep will", key)


def adopt_results(session: Session, job: FineTuneJob, stored: ObjectInfo) -> None:
    """Record the stored CSV as the tenant's file and the job's result file (in the caller's transaction)."""
    file_id = results_file_id_for_job(job.id)
    if session.get(File, file_id) is None:
        session.add(
            File(
                id=file_id,
                tenant_id=job.tenant_id,
                filename=STEP_METRICS_FILE,
                purpose=RESULTS_PURPOSE,
                bytes=stored.size,
                sha256=stored.sha256 or "",
                storage_key=stored.key,
            )
        )
    job.result_files = [file_id]
