"""``/v1/files``: upload (streamed, validated line by line, size-capped), list, retrieve, delete, download."""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlmodel import or_, select
from starlette.concurrency import run_in_threadpool

from api.deps import Context, CurrentTenant
from api.multipart import FORM_OVERHEAD_BYTES, FilePart, StreamingForm, read_form
from api.ownership import get_owned
from api.pagination import After, Order, build_page, page_query
from api.routers.files_schemas import PURPOSE_FINE_TUNE, UPLOAD_REQUEST_BODY, FileDeleted, FileList, FileObject
from api.spools import DatasetSpool
from core.descriptor import file_key
from core.errors import Conflict, InvalidRequest
from core.ids import new_id, now
from core.models import File, FineTuneJob, JobStatus
from core.storage import ObjectInfo, ObjectStore

router = APIRouter(prefix="/v1/files", tags=["files"])

FILE_FIELD = "file"
TEXT_FIELDS = frozenset({"purpose"})
MAX_FILES_LIMIT = 10_000  # OpenAI lists up to 10,000 files per page


def _check_purpose(purpose: str | None) -> str:
    if purpose is None:
        raise InvalidRequest("missing the 'purpose' form field; use purpose=fine-tune", param="purpose")
    if purpose != PURPOSE_FINE_TUNE:
        raise InvalidRequest(
            f"purpose {purpose!r} is not supported here; only {PURPOSE_FINE_TUNE!r} files are accepted",
            param="purpose",
        )
    return purpose


def _store_file(store: ObjectStore, key: str, path: Path, max_bytes: int) -> ObjectInfo:
    with open(path, "rb") as f:
        return store.put_stream(key, f, max_bytes=max_bytes, content_type="application/jsonl")


@router.post("", response_model=FileObject, openapi_extra=UPLOAD_REQUEST_BODY, summary="Upload a training file")
async def upload_file(request: Request, ctx: Context, tenant: CurrentTenant) -> FileObject:
    """Upload JSONL for fine-tuning (multipart: ``file``, ``purpose=fine-tune``); invalid lines are listed."""
    cap = ctx.settings.max_upload_bytes
    file_id = new_id("file")
    with tempfile.TemporaryDirectory(prefix="loraplex-upload-") as tmp, ExitStack() as cleanup:
        received: list[tuple[FilePart, DatasetSpool]] = []

        def open_file(part: FilePart) -> DatasetSpool:
            if part.field != FILE_FIELD:
                raise InvalidRequest(
                    f"unexpected file field {part.field!r}; send the JSONL as 'file'", param=part.field
                )
            if "purpose" in form.fields:  # refuse before reading the file when the purpose came first
                _check_purpose(form.fields["purpose"])
            spool = DatasetSpool(Path(tmp) / "upload.jsonl", max_bytes=cap)
            cleanup.callback(spool.discard)
            received.append((part, spool))
            return spool

        form = StreamingForm(request.headers.get("content-type"), open_file, text_fields=TEXT_FIELDS)
        await read_form(request, form, max_body_bytes=cap + FORM_OVERHEAD_BYTES)
        purpose = _check_purpose(form.fields.get("purpose"))
        if not received:
            raise InvalidRequest("missing the 'file' part (the JSONL to upload)", param=FILE_FIELD)
        part, spool = received[0]
        report = spool.report
        if not report.ok:
            raise InvalidRequest(report.summary(), param=FILE_FIELD, code="invalid_file")
        key = file_key(tenant.id, file_id)
        info = await run_in_threadpool(_store_file, ctx.store, key, spool.path, cap)

    row = File(
        id=file_id,
        tenant_id=tenant.id,
        filename=part.filename,
        purpose=purpose,
        bytes=info.size,
        sha256=info.sha256 or "",
        storage_key=key,
        status="processed",
        format=report.format,
        num_examples=report.num_examples,
    )
    await run_in_threadpool(ctx.insert_or_undo, row, partial(ctx.store.delete, key))
    return FileObject.from_row(row)


@router.get("", response_model=FileList, summary="List files")
def list_files(
    ctx: Context,
    tenant: CurrentTenant,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=MAX_FILES_LIMIT)] = MAX_FILES_LIMIT,
    order: Order = "desc",
    purpose: Annotated[str | None, Query(max_length=32)] = None,
) -> FileList:
    """The caller's files, newest first by default."""
    stmt = select(File).where(File.tenant_id == tenant.id, File.deleted_at.is_(None))  # type: ignore[union-attr]
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    with ctx.session() as session:
        rows = session.exec(page_query(stmt, File.id, after=after, limit=limit, descending=order == "desc")).all()
    return build_page(FileList, rows, limit, FileObject.from_row)


@router.get("/{file_id}", response_model=FileObject, summary="Retrieve a file")
def retrieve_file(file_id: str, ctx: Context, tenant: CurrentTenant) -> FileObject:
    """One of the caller's files."""
    with ctx.session() as session:
        return FileObject.from_row(get_owned(session, File, file_id, tenant, noun="file"))


@router.delete("/{file_id}", response_model=FileDeleted, summary="Delete a file")
def delete_file(file_id: str, ctx: Context, tenant: CurrentTenant) -> FileDeleted:
    """Delete a file and its bytes; refused while an unfinished job still trains on it."""
    with ctx.session() as session:
        row = get_owned(session, File, file_id, tenant, noun="file")
        user = session.exec(
            select(FineTuneJob.id).where(
                FineTuneJob.tenant_id == tenant.id,
                FineTuneJob.status.not_in(JobStatus.TERMINAL),  # type: ignore[attr-defined]
                or_(FineTuneJob.training_file == file_id, FineTuneJob.validation_file == file_id),
            )
        ).first()
    if user is not None:
        raise Conflict(f"file {file_id!r} is used by job {user!r}, which has not finished; cancel it first")
    # Bytes first: if the store fails the row stays and the client can simply retry the delete.
    ctx.store.delete(row.storage_key)
    with ctx.session() as session:
        current = session.get(File, file_id)
        if current is not None and current.deleted_at is None:
            current.deleted_at = now()
            session.add(current)
    return FileDeleted(id=file_id)


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
    summary="Download a file's content",
)
def file_content(file_id: str, ctx: Context, tenant: CurrentTenant) -> StreamingResponse:
    """The file's bytes, streamed from the object store."""
    with ctx.session() as session:
        row = get_owned(session, File, file_id, tenant, noun="file")
    chunks = ctx.store.iter_chunks(row.storage_key)  # raises before the first byte if the object is gone
    return StreamingResponse(
        chunks,
        media_type="application/octet-stream",
        headers={
            "content-length": str(row.bytes),
            "content-disposition": f"attachment; filename*=UTF-8''{quote(row.filename)}",
        },
    )
