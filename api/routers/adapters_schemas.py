"""Shapes of ``/v1/adapters``: a LoRA adapter the caller owns, trained here or uploaded."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.multipart import binary_field, openapi_form
from api.naming import SUFFIX_MAX, SUFFIX_PATTERN
from api.pagination import ListPage
from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from core.models import Adapter


class AdapterObject(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    model: str = Field(description="The model name to call it by (ft:{base}:{tenant}:{suffix}:{id}).")
    base_model: str
    source: Literal["fine_tune", "upload", "checkpoint"]
    job_id: str | None = Field(description="The job that trained it (fine_tune and checkpoint adapters).")
    rank: int = Field(description="Largest LoRA rank across its modules.")
    alpha: float
    target_modules: list[str]
    size_bytes: int
    sha256: str = Field(description=f"sha256 of {ADAPTER_WEIGHTS_FILE}.")
    created_at: int

    @classmethod
    def from_row(cls, row: Adapter) -> AdapterObject:
        return cls(
            id=row.id,
            model=row.name,
            base_model=row.base_model,
            source=row.source,  # type: ignore[arg-type]  # the column holds one of the three
            job_id=row.job_id,
            rank=row.rank,
            alpha=row.alpha,
            target_modules=list(row.target_modules),
            size_bytes=row.size_bytes,
            sha256=row.sha256,
            created_at=row.created_at,
        )


class AdapterList(ListPage[AdapterObject]):
    """A page of adapters, newest first."""


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    deleted: bool = True


# The upload route streams its body itself, so its OpenAPI request body is declared by hand.
UPLOAD_REQUEST_BODY = openapi_form(
    {
        ADAPTER_CONFIG_FILE: binary_field("PEFT adapter_config.json (LoRA)."),
        ADAPTER_WEIGHTS_FILE: binary_field("PEFT weights in safetensors; pickle (.bin) files are refused."),
        "suffix": {
            "type": "string",
            "maxLength": SUFFIX_MAX,
            "pattern": SUFFIX_PATTERN,
            "description": "Goes into the model name, as for fine-tuning jobs.",
        },
    },
    required=[ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE],
)
