"""From a job request to a queued job: check everything the client sent, record the job, hand it to a worker.

States: the row is created ``validating_files``; once its files are confirmed in the object store it
becomes ``queued`` and is published to Redis. If publishing fails (Redis down) the row and its events
are deleted and the client gets 503 with ``retry-after``: a retry creates the job afresh, so nothing is
left half-created and nothing runs twice. Should this process die between insert and publish, the row
stays ``validating_files`` or ``queued`` without a message: workers fail the first and publish the second
again (``worker.requeue``). A job ended by someone else while its files were checked (cancelled, or failed
as an interrupted submission) stays ended: the client gets 409 and the row is kept.
"""

from __future__ import annotations

import logging
import secrets

from sqlmodel import Session, delete

from api.base_model import BaseModels
from api.context import ApiContext
from api.ownership import ServedModel, find_served_model, plausible_id
from api.routers.fine_tuning_schemas import MAX_SEED, JobCreate
from core.dataset_format import method_format_problem
from core.errors import InvalidRequest, NotFound, ObjectNotFound
from core.hyperparameters import ResolvedHyperparameters
from core.ids import new_id
from core.job_states import IllegalTransition, mark_queued
from core.jobs import lock_job, record_event
from core.models import Adapter, File, FineTuneJob, JobEvent, Tenant
from core.settings import Settings

log = logging.getLogger(__name__)

# ResolvedHyperparameters.resolve() names the field first in its messages ("lora_r must be ...").
_RESOLVE_FIELDS = ("lora_r", "max_seq_len", "target_modules", "beta")
# What a job that continues a fine-tuned model takes from it: the adapter's shape, which training extends.
_INHERITED = ("lora_r", "lora_alpha", "target_modules")


def resolve_hyperparameters(
    body: JobCreate,
    settings: Settings,
    context_length: int | None,
    model_type: str | None = None,
    num_examples: int | None = None,
    parent: Adapter | None = None,
) -> ResolvedHyperparameters:
    """Concrete hyperparameters (``auto`` ones from the training file's ``num_examples``; the adapter's shape
    from ``parent``, the fine-tuned model the job continues), or ``InvalidRequest`` whose ``param`` names the
    offending one."""
    requested, where = body.requested_hyperparameters()
    if body.hyperparameters is not None and body.method is not None and where != "hyperparameters":
        raise InvalidRequest("give hyperparameters either at the top level or in method, not both", param="method")
    if parent is not None:
        shape = {"lora_r": parent.rank, "lora_alpha": parent.alpha, "target_modules": list(parent.target_modules)}
        for name in _INHERITED:
            given = getattr(requested, name)
            if name in requested.model_fields_set and given is not None and given != shape[name]:
                raise InvalidRequest(
                    f"{name} is {shape[name]!r} in {parent.name!r}, which this job continues; leave {name} out",
                    param=f"{where}.{name}",
                )
        requested = requested.model_copy(update=shape)
    try:
        return requested.resolve(
            max_lora_rank=settings.max_lora_rank,
            method=body.method_type,
            context_length=context_length,
            model_type=model_type,
            num_examples=num_examples,
        )
    except ValueError as exc:
        message = str(exc)
        field = next((f for f in _RESOLVE_FIELDS if message.startswith(f)), None)
        raise InvalidRequest(message, param=f"{where}.{field}" if field else where) from None


def resolve_model(session: Session, tenant: Tenant, model: str, bases: BaseModels) -> ServedModel:
    """What ``model`` trains on: one of the served bases, or one of the tenant's fine-tuned models on one, whose
    adapter the job continues."""
    target = find_served_model(session, tenant, model, bases)
    if target is not None:
        return target
    # Another tenant's model reads exactly like a missing one.
    served = ", ".join(repr(name) for name in bases.names)
    if model.startswith("ft:"):
        raise InvalidRequest(
            f"no fine-tuned model {model!r} of yours to continue here; see /v1/models, or fine-tune a base "
            f"model: {served}",
            param="model",
            code="model_not_available",
        )
    raise InvalidRequest(
        f"model {model!r} cannot be fine-tuned here; the base models are {served}",
        param="model",
        code="model_not_available",
    )


def _fine_tune_file(session: Session, tenant: Tenant, file_id: str, param: str, method: str) -> File:
    row = session.get(File, file_id) if plausible_id(file_id) else None
    # Someone else's file reads exactly like a missing one.
    if row is None or row.tenant_id != tenant.id or row.deleted_at is not None:
        raise InvalidRequest(f"no file with id {file_id!r}; upload it with POST /v1/files", param=param)
    if row.purpose != "fine-tune":
        raise InvalidRequest(f"file {file_id!r} has purpose {row.purpose!r}, not 'fine-tune'", param=param)
    if row.status != "processed":
        raise InvalidRequest(f"file {file_id!r} is {row.status}, not processed: {row.status_details}", param=param)
    problem = method_format_problem(method, row.format)
    if problem is not None:
        raise InvalidRequest(f"file {file_id!r}: {problem}", param=param)
    return row


def _confirm_stored(ctx: ApiContext, files: list[tuple[File, str]]) -> None:
    for file, param in files:
        try:
            info = ctx.store.stat(file.storage_key)
        except ObjectNotFound:
            raise InvalidRequest(f"the content of file {file.id!r} is missing; upload it again", param=param) from None
        if info.size != file.bytes:
            raise InvalidRequest(f"the content of file {file.id!r} changed since upload; upload it again", param=param)


def _discard(ctx: ApiContext, job_id: str) -> None:
    try:
        with ctx.session() as session:
            session.exec(delete(JobEvent).where(JobEvent.job_id == job_id))  # type: ignore[call-overload]
            session.exec(delete(FineTuneJob).where(FineTuneJob.id == job_id))  # type: ignore[call-overload]
    except Exception:
        log.exception("could not remove job %s after a failed submission", job_id)


def queue_validated(session: Session, job_id: str, examples: dict[str, int | None]) -> FineTuneJob:
    """Move a job whose files were confirmed from ``validating_files`` to ``queued``; ``IllegalTransition``
    when it was ended meanwhile."""
    job = lock_job(session, job_id)
    if job is None:
        raise NotFound(f"no fine-tuning job {job_id!r}", param="fine_tuning_job_id")
    mark_queued(job)
    session.add(job)
    record_event(session, job, "Files validated, moving job to queued state", data={"examples": examples})
    return job


def submit_job(ctx: ApiContext, tenant: Tenant, body: JobCreate) -> FineTuneJob:
    """Validate ``body``, create the job and publish it to its base's workers; returns the job (``queued``)."""
    method = body.method_type
    with ctx.session() as session:
        target = resolve_model(session, tenant, body.model, ctx.bases)
        base, parent = target.base, target.adapter
        model_type, context = base.config.get("model_type"), base.context_length
        resolve_hyperparameters(body, ctx.settings, context, model_type, parent=parent)  # bad values first
        files = [(_fine_tune_file(session, tenant, body.training_file, "training_file", method), "training_file")]
        if body.validation_file is not None:
            validation = _fine_tune_file(session, tenant, body.validation_file, "validation_file", method)
            files.append((validation, "validation_file"))
        examples = files[0][0].num_examples
        hyperparameters = resolve_hyperparameters(
            body, ctx.settings, context, model_type, num_examples=examples, parent=parent
        )
        # Created validating_files (the column's default): nothing runs it until queue_validated.
        job = FineTuneJob(
            id=new_id("ftjob"),
            tenant_id=tenant.id,
            base_model=base.name,
            method=method,
            parent_model=parent.name if parent is not None else None,
            parent_adapter_id=parent.id if parent is not None else None,
            training_file=body.training_file,
            validation_file=body.validation_file,
            hyperparameters=hyperparameters.model_dump(),
            suffix=body.suffix,
            seed=body.seed if body.seed is not None else secrets.randbelow(MAX_SEED + 1),
            user_metadata=body.metadata,
        )
        session.add(job)
        record_event(session, job, f"Created fine-tuning job: {job.id}")
    try:
        _confirm_stored(ctx, files)
        with ctx.session() as session:
            job = queue_validated(session, job.id, {param: file.num_examples for file, param in files})
        ctx.jobs.submit(job)
    except IllegalTransition:
        raise  # someone else ended it; their record of why stays
    except BaseException:
        _discard(ctx, job.id)
        raise
    return job
