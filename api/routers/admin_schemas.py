"""Shapes of the ``/admin`` routes: tenants and their API keys (a key's secret appears only at creation)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from api.pagination import ListPage
from core.models import ApiKey, Tenant


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64, description="Lowercase letters, digits, '-', '_'; appears in model names.")


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=128, description="A label to tell keys apart.")


class ApiKeyObject(BaseModel):
    """An API key without its secret."""

    id: str
    object: Literal["api_key"] = "api_key"
    tenant_id: str
    name: str | None
    prefix: str = Field(description="The first characters of the key, to recognise it.")
    created_at: int
    revoked_at: int | None

    @classmethod
    def from_row(cls, row: ApiKey) -> ApiKeyObject:
        return cls(
            id=row.id,
            tenant_id=row.tenant_id,
            name=row.name,
            prefix=row.prefix,
            created_at=row.created_at,
            revoked_at=row.revoked_at,
        )


class NewApiKey(ApiKeyObject):
    """A key just created: ``key`` is the secret, shown this once and never again."""

    key: str


class TenantObject(BaseModel):
    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    disabled: bool
    created_at: int

    @classmethod
    def from_row(cls, row: Tenant) -> TenantObject:
        return cls(id=row.id, name=row.name, disabled=row.disabled, created_at=row.created_at)


class TenantCreated(TenantObject):
    """A new tenant with its first API key (the secret is shown this once)."""

    api_key: NewApiKey


class TenantList(ListPage[TenantObject]):
    """A page of tenants."""


class ApiKeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ApiKeyObject]
