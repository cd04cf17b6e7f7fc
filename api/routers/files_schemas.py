"""Request and response shapes of ``/v1/files`` (the OpenAI file object, plus ``sha256`` and dataset facts)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.multipart import binary_field, openapi_form
from api.pagination import ListPage
from core.models import File

PURPOSE_FINE_TUNE = "fine-tune"


class FileObject(BaseModel):
    """An uploaded file."""

    id: str
    object: Literal["file"] = "file"
    bytes: int = Field(description="Size in bytes.")
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"]
    status_details: str | None = None
    sha256: str = Field(description="sha256 of the stored bytes.")
    format: str | None = Field(default=None, description="Dataset format: chat or prompt_completion.")
    num_examples: int | None = None

    @classmethod
    def from_row(cls, row: File) -> FileObject:
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=row.created_at,
            filename=row.filename,
            purpose=row.purpose,
            status=row.status,  # type: ignore[arg-type]  # the column holds one of the three
            status_details=row.status_details,
            sha256=row.sha256,
            format=row.format,
            num_examples=row.num_examples,
        )


class FileList(ListPage[FileObject]):
    """A page of files."""


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# The upload route streams its body itself, so its OpenAPI request body is declared by hand.
UPLOAD_REQUEST_BODY = openapi_form(
    {
        "file": binary_field("JSONL: one chat ({messages}) or prompt/completion example per line."),
        "purpose": {"type": "string", "enum": [PURPOSE_FINE_TUNE]},
    },
    required=["file", "purpose"],
)
