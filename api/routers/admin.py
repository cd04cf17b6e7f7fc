"""``/admin``: tenants and their API keys, behind the admin key (``LORAPLEX_ADMIN_KEY``)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlmodel import select

from api.deps import AdminAccess, Context
from api.pagination import After, Limit, build_page, page_query
from api.routers.admin_schemas import (
    ApiKeyList,
    ApiKeyObject,
    KeyCreate,
    NewApiKey,
    TenantCreate,
    TenantCreated,
    TenantList,
    TenantObject,
)
from core.accounts import create_api_key, create_tenant, get_tenant, revoke_api_key
from core.models import ApiKey, Tenant

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminAccess])

TenantRef = str  # a tenant id (tenant-...) or its name


def _new_key(row: ApiKey, secret: str) -> NewApiKey:
    return NewApiKey(**ApiKeyObject.from_row(row).model_dump(), key=secret)


@router.post("/tenants", status_code=201, response_model=TenantCreated, summary="Create a tenant")
def create_tenant_route(body: TenantCreate, ctx: Context) -> TenantCreated:
    """A new tenant and its first API key (the key is in the response only this once)."""
    with ctx.session() as session:
        tenant, secret = create_tenant(session, body.name)
        key_row = session.exec(select(ApiKey).where(ApiKey.tenant_id == tenant.id)).one()
    return TenantCreated(**TenantObject.from_row(tenant).model_dump(), api_key=_new_key(key_row, secret))


@router.get("/tenants", response_model=TenantList, summary="List tenants")
def list_tenants(ctx: Context, after: After = None, limit: Limit = 20) -> TenantList:
    """Tenants, newest first."""
    with ctx.session() as session:
        rows = session.exec(page_query(select(Tenant), Tenant.id, after=after, limit=limit)).all()
    return build_page(TenantList, rows, limit, TenantObject.from_row)


@router.get("/tenants/{tenant}", response_model=TenantObject, summary="Retrieve a tenant")
def retrieve_tenant(tenant: TenantRef, ctx: Context) -> TenantObject:
    """A tenant by id or name."""
    with ctx.session() as session:
        return TenantObject.from_row(get_tenant(session, tenant))


def _set_disabled(ctx: Context, tenant_ref: str, disabled: bool) -> TenantObject:
    with ctx.session() as session:
        tenant = get_tenant(session, tenant_ref)
        tenant.disabled = disabled
        session.add(tenant)
        return TenantObject.from_row(tenant)


@router.post("/tenants/{tenant}/disable", response_model=TenantObject, summary="Disable a tenant")
def disable_tenant(tenant: TenantRef, ctx: Context) -> TenantObject:
    """Refuse the tenant's keys (403) until enabled again; its data stays."""
    return _set_disabled(ctx, tenant, True)


@router.post("/tenants/{tenant}/enable", response_model=TenantObject, summary="Enable a tenant")
def enable_tenant(tenant: TenantRef, ctx: Context) -> TenantObject:
    """Accept the tenant's keys again."""
    return _set_disabled(ctx, tenant, False)


@router.get("/tenants/{tenant}/keys", response_model=ApiKeyList, summary="List a tenant's API keys")
def list_keys(tenant: TenantRef, ctx: Context) -> ApiKeyList:
    """Every key of the tenant, revoked ones included (secrets are never shown again)."""
    with ctx.session() as session:
        owner = get_tenant(session, tenant)
        rows = session.exec(select(ApiKey).where(ApiKey.tenant_id == owner.id).order_by(ApiKey.id)).all()
    return ApiKeyList(data=[ApiKeyObject.from_row(row) for row in rows])


@router.post("/tenants/{tenant}/keys", status_code=201, response_model=NewApiKey, summary="Create an API key")
def create_key(tenant: TenantRef, ctx: Context, body: KeyCreate | None = None) -> NewApiKey:
    """Another key for the tenant; the secret is in the response only this once."""
    with ctx.session() as session:
        row, secret = create_api_key(session, get_tenant(session, tenant), name=body.name if body else None)
    return _new_key(row, secret)


@router.delete("/tenants/{tenant}/keys/{key_id}", response_model=ApiKeyObject, summary="Revoke an API key")
def revoke_key(tenant: TenantRef, key_id: str, ctx: Context) -> ApiKeyObject:
    """Revoke a key (idempotent); requests with it get 401 from then on."""
    with ctx.session() as session:
        owner = get_tenant(session, tenant)
        return ApiKeyObject.from_row(revoke_api_key(session, key_id, tenant_id=owner.id))
