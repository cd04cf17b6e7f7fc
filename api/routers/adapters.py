"""``/v1/adapters``: the caller's LoRA adapters; upload your own PEFT adapter, list, retrieve, delete."""

from __future__ import annotations

import json
import tempfile
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from fastapi import APIRouter, Request
from sqlmodel import select
from starlette.concurrency import run_in_threadpool

from api.adapter_lifecycle import (
    ADAPTER_FILES,
    adapter_file_of,
    retire_adapter,
    store_adapter_files,
    uploaded_adapter_row,
)
from api.base_model import BaseModelInfo
from api.deps import Context, CurrentTenant
from api.multipart import FORM_OVERHEAD_BYTES, FilePart, StreamingForm, read_form
from api.naming import check_suffix
from api.ownership import get_owned
from api.pagination import After, Limit, build_page, page_query
from api.routers.adapters_schemas import UPLOAD_REQUEST_BODY, AdapterDeleted, AdapterList, AdapterObject
from api.spools import FileSpool
from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, MAX_CONFIG_BYTES, inspect_adapter
from core.adapter_values import check_finite_weights
from core.base_fingerprint import BaseModelMismatch, check_origin, read_adapter_origin
from core.descriptor import adapter_prefix
from core.errors import InvalidRequest
from core.ids import new_id
from core.models import Adapter

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])
NOUN = "adapter"
TEXT_FIELDS = frozenset({"suffix", "model"})


def _base_of_upload(ctx: Context, fields: dict[str, str], adapter_dir: Path) -> BaseModelInfo:
    """The base an uploaded adapter is for: the ``model`` field when sent, else the base its weights file
    records (``core.base_fingerprint``), else the base its ``adapter_config.json`` names when this platform
    serves one by that name, else the default base. An adapter that records or names another base than the
    one chosen is refused, saying which base it was made for."""
    origin = read_adapter_origin(adapter_dir / ADAPTER_WEIGHTS_FILE)
    declared = _declared_base(adapter_dir)
    named = fields.get("model")
    if named:
        base = ctx.bases.get(named)
        if base is None:
            served = ", ".join(repr(name) for name in ctx.bases.names)
            raise InvalidRequest(f"{named!r} is not a base model here; choose one of {served}", param="model")
    else:
        recorded = ctx.bases.made_on(origin.fingerprint) if origin else None
        base = recorded or (ctx.bases.get(declared) if declared else None) or ctx.base_model
    other = ctx.bases.get(declared) if declared else None
    if other is not None and other.name != base.name and not other.same_weights(base):
        raise BaseModelMismatch(
            f"adapter_config.json says this adapter was made on base model {declared!r}, not {base.name!r}; "
            f"upload it with model={declared!r}",
            param="model",
        )
    if base.fingerprint is not None:
        check_origin(origin, base.fingerprint)
    return base


def _declared_base(adapter_dir: Path) -> str | None:
    """The ``base_model_name_or_path`` of the adapter's config, if it is a string."""
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
        declared = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    except (OSError, ValueError, RecursionError):
        declared = None  # inspect_adapter says what is wrong with the file
    return declared if isinstance(declared, str) and declared else None


def _suffix(fields: dict[str, str]) -> str | None:
    try:
        return check_suffix(fields.get("suffix") or None)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="suffix") from None


@router.post("", response_model=AdapterObject, openapi_extra=UPLOAD_REQUEST_BODY, summary="Upload a PEFT adapter")
async def upload_adapter(request: Request, ctx: Context, tenant: CurrentTenant) -> AdapterObject:
    """Bring your own LoRA (multipart: adapter_config.json, adapter_model.safetensors, optional ``suffix`` and
    ``model``: the base it is for), checked against that base."""
    cap = ctx.settings.max_upload_bytes
    adapter_id = new_id("adapter")
    with tempfile.TemporaryDirectory(prefix="loraplex-adapter-") as tmp, ExitStack() as cleanup:
        adapter_dir = Path(tmp)
        spools: dict[str, FileSpool] = {}

        def open_file(part: FilePart) -> FileSpool:
            name = adapter_file_of(part)
            if name in spools:
                raise InvalidRequest(f"{name} was sent twice", param=part.field)
            limit = MAX_CONFIG_BYTES if name == ADAPTER_CONFIG_FILE else cap
            spool = spools[name] = FileSpool(adapter_dir / name, max_bytes=limit, what=name)
            cleanup.callback(spool.discard)
            return spool

        form = StreamingForm(request.headers.get("content-type"), open_file, text_fields=TEXT_FIELDS)
        await read_form(request, form, max_body_bytes=cap + MAX_CONFIG_BYTES + FORM_OVERHEAD_BYTES)
        suffix = _suffix(form.fields)
        missing = [name for name in ADAPTER_FILES if name not in spools]
        if missing:
            raise InvalidRequest(f"the upload lacks {missing[0]}; send {' and '.join(ADAPTER_FILES)}", param=missing[0])
        base = _base_of_upload(ctx, form.fields, adapter_dir)
        spec = await run_in_threadpool(inspect_adapter, adapter_dir, base.shapes, ctx.settings.max_lora_rank)
        await run_in_threadpool(check_finite_weights, spec)  # servers refuse NaN/inf: refuse it now, not per request
        prefix = adapter_prefix(tenant.id, adapter_id)
        stored = await run_in_threadpool(store_adapter_files, ctx.store, prefix, adapter_dir)

    row = uploaded_adapter_row(base, tenant, adapter_id, spec, stored, suffix)
    await run_in_threadpool(ctx.insert_or_undo, row, partial(ctx.store.delete_prefix, prefix))
    return AdapterObject.from_row(row)


@router.get("", response_model=AdapterList, summary="List adapters")
def list_adapters(ctx: Context, tenant: CurrentTenant, after: After = None, limit: Limit = 20) -> AdapterList:
    """The caller's adapters, newest first."""
    stmt = select(Adapter).where(Adapter.tenant_id == tenant.id, Adapter.deleted_at.is_(None))  # type: ignore[union-attr]
    with ctx.session() as session:
        rows = session.exec(page_query(stmt, Adapter.id, after=after, limit=limit)).all()
    return build_page(AdapterList, rows, limit, AdapterObject.from_row)


@router.get("/{adapter_id}", response_model=AdapterObject, summary="Retrieve an adapter")
def retrieve_adapter(adapter_id: str, ctx: Context, tenant: CurrentTenant) -> AdapterObject:
    """One of the caller's adapters."""
    with ctx.session() as session:
        return AdapterObject.from_row(get_owned(session, Adapter, adapter_id, tenant, noun=NOUN))


@router.delete("/{adapter_id}", response_model=AdapterDeleted, summary="Delete an adapter")
def delete_adapter(adapter_id: str, ctx: Context, tenant: CurrentTenant) -> AdapterDeleted:
    """Delete an adapter and its files; its model name stops working."""
    with ctx.session() as session:
        adapter = get_owned(session, Adapter, adapter_id, tenant, noun=NOUN)
    retire_adapter(ctx, adapter)
    return AdapterDeleted(id=adapter_id)
