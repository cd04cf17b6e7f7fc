"""Bytes tenants hold in the object store (training files and adapters) at a moment in time."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlmodel import Session, col, select

from core.models import Adapter, File


@dataclass(frozen=True)
class StoredObject:
    tenant_id: str
    adapter_id: str | None  # None for training files
    size: int
    created_at: int
    deleted_at: int | None

    def held_at(self, moment: int) -> bool:
        return self.created_at < moment and (self.deleted_at is None or self.deleted_at >= moment)


def stored_objects(session: Session, before: int, *, tenant_id: str | None = None) -> list[StoredObject]:
    """Files and adapters created before ``before`` (deleted ones too: they were held for a while)."""
    files = select(File.tenant_id, File.bytes, File.created_at, File.deleted_at).where(col(File.created_at) < before)
    adapters = select(Adapter.tenant_id, Adapter.id, Adapter.size_bytes, Adapter.created_at, Adapter.deleted_at).where(
        col(Adapter.created_at) < before
    )
    if tenant_id is not None:
        files = files.where(col(File.tenant_id) == tenant_id)
        adapters = adapters.where(col(Adapter.tenant_id) == tenant_id)
    objects = [StoredObject(t, None, int(n), c, d) for t, n, c, d in session.exec(files).all()]
    objects += [StoredObject(t, a, int(n), c, d) for t, a, n, c, d in session.exec(adapters).all()]
    return objects


def held_bytes(objects: list[StoredObject], moment: int, group: str) -> dict[str | None, int]:
    """Bytes held at ``moment`` per tenant id (``group="tenant"``) or adapter id (``"adapter"``; files: None)."""
    held: dict[str | None, int] = defaultdict(int)
    for obj in objects:
        if obj.held_at(moment):
            held[obj.tenant_id if group == "tenant" else obj.adapter_id] += obj.size
    return dict(held)


def total_held(objects: list[StoredObject], moment: int) -> int:
    """All bytes held at ``moment``."""
    return sum(obj.size for obj in objects if obj.held_at(moment))
