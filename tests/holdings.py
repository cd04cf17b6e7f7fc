"""What a tenant holds on the platform (live rows, stored objects, tokens billed), read straight from the
database and the object store: refused or failed requests must leave it exactly as it was."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import col, func, select

from core import db
from core.models import Adapter, File, FineTuneJob, UsageRecord
from core.settings import Settings
from core.storage import open_store


@dataclass(frozen=True)
class Holdings:
    files: frozenset[str]
    adapters: frozenset[str]
    jobs: frozenset[str]
    objects: frozenset[str]  # keys under the tenant's prefix in the object store
    billed_tokens: int  # prompt + completion tokens of its inference usage records


def holdings(settings: Settings, engine: Engine, tenant_id: str) -> Holdings:
    """What ``tenant_id`` holds now."""
    with db.read_session(engine) as session:
        files = session.exec(select(File.id).where(File.tenant_id == tenant_id, col(File.deleted_at).is_(None)))
        adapters = session.exec(
            select(Adapter.id).where(Adapter.tenant_id == tenant_id, col(Adapter.deleted_at).is_(None))
        )
        jobs = session.exec(select(FineTuneJob.id).where(FineTuneJob.tenant_id == tenant_id))
        file_ids, adapter_ids, job_ids = frozenset(files.all()), frozenset(adapters.all()), frozenset(jobs.all())
        billed = session.exec(
            select(func.coalesce(func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens), 0)).where(
                UsageRecord.tenant_id == tenant_id, UsageRecord.kind == "inference"
            )
        ).one()
    objects = frozenset(o.key for o in open_store(settings).list(f"tenants/{tenant_id}/"))
    return Holdings(file_ids, adapter_ids, job_ids, objects, int(billed))
