"""Shapes of ``/v1/models``: OpenAI's model object, with ``parent`` (the base) for adapters, as vLLM does."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.base_model import BaseModelInfo
from core.models import Adapter, Tenant

PLATFORM_OWNER = "loraplex"


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = Field(default=None, description="The base model an adapter applies to.")
    adapter_id: str | None = None

    @classmethod
    def base(cls, info: BaseModelInfo) -> ModelObject:
        return cls(id=info.name, created=info.created, owned_by=PLATFORM_OWNER)

    @classmethod
    def adapter(cls, row: Adapter, owner: Tenant) -> ModelObject:
        return cls(id=row.name, created=row.created_at, owned_by=owner.name, parent=row.base_model, adapter_id=row.id)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True
