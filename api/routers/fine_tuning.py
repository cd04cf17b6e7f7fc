"""``/v1/fine_tuning/jobs``: create, list, retrieve, cancel, the event log of a job and its checkpoints."""

from __future__ import annotations

import re
import time

from fastapi import APIRouter, Request
from sqlmodel import select
from sqlmodel.sql.expression import SelectOfScalar

from api.deps import Context, CurrentTenant
from api.job_submission import submit_job
from api.ownership import get_owned
from api.pagination import After, Limit, build_page, page_query
from api.routers.fine_tuning_schemas import (
    EVENT_ID_PREFIX,
    CheckpointList,
    CheckpointObject,
    FineTuningJobObject,
    JobCreate,
    JobEventList,
    JobEventObject,
    JobList,
)
from core.errors import InvalidRequest
from core.jobs import live_checkpoints, request_cancel, with_metadata
from core.models import FineTuneJob, FineTuningCheckpoint, JobEvent, JobStatus

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"])
NOUN = "fine-tuning job"
_EVENT_NUMBER = re.compile(r"[0-9]{1,18}")  # fits a 64-bit integer column
_METADATA_FILTER = re.compile(r"metadata\[(.+)\]")  # metadata[key]=value, as the openai SDK sends a filter
# A running job stops after its current step; cancel waits this long for that, so that it can answer
# ``cancelled`` as OpenAI does, and otherwise answers ``running`` with the cancel on its way.
CANCEL_WAIT_S, CANCEL_POLL_S = 5.0, 0.1


@router.post("", response_model=FineTuningJobObject, summary="Create a fine-tuning job")
def create_job(body: JobCreate, ctx: Context, tenant: CurrentTenant) -> FineTuningJobObject:
    """Queue a LoRA fine-tune of the base model on an uploaded file; 503 with retry-after if the queue is down."""
    return FineTuningJobObject.from_row(submit_job(ctx, tenant, body))


@router.get("", response_model=JobList, summary="List fine-tuning jobs")
def list_jobs(request: Request, ctx: Context, tenant: CurrentTenant, after: After = None, limit: Limit = 20) -> JobList:
    """The caller's jobs, newest first; ``metadata[key]=value`` (repeatable) keeps those whose metadata has
    every pair given, ``metadata=null`` those without metadata."""
    stmt = _metadata_filter(select(FineTuneJob).where(FineTuneJob.tenant_id == tenant.id), request)
    with ctx.session() as session:
        rows = session.exec(page_query(stmt, FineTuneJob.id, after=after, limit=limit)).all()
    return build_page(JobList, rows, limit, FineTuningJobObject.from_row)


@router.get("/{job_id}", response_model=FineTuningJobObject, summary="Retrieve a fine-tuning job")
def retrieve_job(job_id: str, ctx: Context, tenant: CurrentTenant) -> FineTuningJobObject:
    """One of the caller's jobs."""
    with ctx.session() as session:
        return FineTuningJobObject.from_row(get_owned(session, FineTuneJob, job_id, tenant, noun=NOUN))


@router.post("/{job_id}/cancel", response_model=FineTuningJobObject, summary="Cancel a fine-tuning job")
def cancel_job(job_id: str, ctx: Context, tenant: CurrentTenant) -> FineTuningJobObject:
    """Cancel a job: at once when it has not started, after the current training step when it runs (the
    answer waits a few seconds for that, then says ``running`` if the step is longer); a finished job
    answers 409."""
    with ctx.session() as session:
        job = request_cancel(session, get_owned(session, FineTuneJob, job_id, tenant, noun=NOUN))
    deadline = time.monotonic() + CANCEL_WAIT_S
    while job.status == JobStatus.RUNNING and time.monotonic() < deadline:
        time.sleep(CANCEL_POLL_S)  # pacing the reads; the loop waits on the job's status
        with ctx.reading() as session:  # read-only: SQLite's one writer is the worker, stopping the job
            job = session.get(FineTuneJob, job_id, populate_existing=True) or job
    return FineTuningJobObject.from_row(job)


def _metadata_filter(stmt: SelectOfScalar[FineTuneJob], request: Request) -> SelectOfScalar[FineTuneJob]:
    pairs: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name == "metadata" and value == "null":
            return with_metadata(stmt, None)
        if name == "metadata":
            raise InvalidRequest("filter by metadata with metadata[key]=value, or metadata=null", param="metadata")
        if match := _METADATA_FILTER.fullmatch(name):
            pairs[match[1]] = value
    return with_metadata(stmt, pairs) if pairs else stmt


def _event_cursor(after: str | None) -> int | None:
    if after is None:
        return None
    number = after.removeprefix(EVENT_ID_PREFIX)
    if not _EVENT_NUMBER.fullmatch(number):
        raise InvalidRequest(f"after must be an event id such as '{EVENT_ID_PREFIX}42', got {after!r}", param="after")
    return int(number)


@router.get("/{job_id}/events", response_model=JobEventList, summary="List a job's events")
def list_events(
    job_id: str, ctx: Context, tenant: CurrentTenant, after: After = None, limit: Limit = 20
) -> JobEventList:
    """Status changes, progress and metrics of a job, newest first."""
    cursor = _event_cursor(after)
    with ctx.session() as session:
        get_owned(session, FineTuneJob, job_id, tenant, noun=NOUN)
        stmt = select(JobEvent).where(JobEvent.job_id == job_id)
        rows = session.exec(page_query(stmt, JobEvent.id, after=cursor, limit=limit)).all()
    return build_page(JobEventList, rows, limit, JobEventObject.from_row)


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, summary="List a job's checkpoints")
def list_checkpoints(
    job_id: str, ctx: Context, tenant: CurrentTenant, after: After = None, limit: Limit = 10
) -> CheckpointList:
    """The job's kept epoch checkpoints (its last three), newest first; each serves under its
    ``fine_tuned_model_checkpoint`` name."""
    with ctx.session() as session:
        get_owned(session, FineTuneJob, job_id, tenant, noun=NOUN)
        stmt = live_checkpoints(job_id)
        rows = session.exec(page_query(stmt, FineTuningCheckpoint.id, after=after, limit=limit)).all()
    return build_page(CheckpointList, rows, limit, lambda pair: CheckpointObject.from_rows(*pair))
