"""``/v1/models``: the base models and the caller's adapters on them, by the names inference takes."""

from __future__ import annotations

from fastapi import APIRouter
from sqlmodel import col, select

from api.adapter_lifecycle import retire_adapter
from api.deps import Context, CurrentTenant
from api.ownership import find_owned_adapter
from api.routers.models_schemas import ModelDeleted, ModelList, ModelObject
from core.errors import NotFound, PermissionDenied
from core.models import Adapter, Tenant

router = APIRouter(prefix="/v1/models", tags=["models"])


def _owned_adapter(ctx: Context, tenant: Tenant, model: str) -> Adapter:
    with ctx.session() as session:
        row = find_owned_adapter(session, tenant, model)
    if row is None:
        raise NotFound(f"no model {model!r}; GET /v1/models lists yours", param="model", code="model_not_found")
    return row


@router.get("", response_model=ModelList, summary="List models")
def list_models(ctx: Context, tenant: CurrentTenant) -> ModelList:
    """Every base model (the default first), then the caller's adapters on them (newest first)."""
    with ctx.session() as session:
        rows = session.exec(
            select(Adapter)
            .where(
                Adapter.tenant_id == tenant.id,
                Adapter.deleted_at.is_(None),  # type: ignore[union-attr]
                col(Adapter.base_model).in_(ctx.bases.names),
            )
            .order_by(Adapter.id.desc())  # type: ignore[union-attr]
        ).all()
    bases = [ModelObject.base(base) for base in ctx.bases]
    return ModelList(data=[*bases, *(ModelObject.adapter(r, tenant) for r in rows)])


# `:path` because model names may hold '/' (a base model named like "org/model").
@router.get("/{model:path}", response_model=ModelObject, summary="Retrieve a model")
def retrieve_model(model: str, ctx: Context, tenant: CurrentTenant) -> ModelObject:
    """A base model, or one of the caller's adapters by its model name."""
    base = ctx.bases.get(model)
    if base is not None:
        return ModelObject.base(base)
    return ModelObject.adapter(_owned_adapter(ctx, tenant, model), tenant)


@router.delete("/{model:path}", response_model=ModelDeleted, summary="Delete a fine-tuned model")
def delete_model(model: str, ctx: Context, tenant: CurrentTenant) -> ModelDeleted:
    """Delete one of the caller's adapters by model name (the base model cannot be deleted)."""
    if model in ctx.bases:
        raise PermissionDenied(f"{model!r} is one of the platform's base models and cannot be deleted", param="model")
    retire_adapter(ctx, _owned_adapter(ctx, tenant, model))
    return ModelDeleted(id=model)
