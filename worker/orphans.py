"""Objects no row points at are removed, so a crash between writing bytes and recording them leaks nothing.

Every writer stores objects before the row that names them (``api/routers/files.py``,
``api/adapter_lifecycle.py``, ``worker/run_job.py``, ``worker/checkpoints.py``) and undoes the objects if
the row cannot be written. The undo itself can fail (the store went down mid-upload) or never run (the process
was killed), leaving objects that nothing references: invisible to tenants, yet stored and paid for. The sweep
finds them:

- ``tenants/{t}/files/{file}``: kept while a live ``File`` row of that tenant has that key, or while the job
  whose metrics file it is has not ended (a redelivery adopts it);
- ``tenants/{t}/adapters/{adapter}/...``: kept while a live ``Adapter`` row has that prefix, or while the
  fine-tuning job that writes it has not ended (a redelivery finalizes from those objects); a checkpoint's
  training state lives under its adapter's prefix (``state/``) and goes with it;
- anything else is not ours to judge and is left alone.

Only objects older than a grace period are candidates, which covers a writer between its upload and its
row. Each pass lists the store once; workers run it now and then (``worker.app``), and several workers
sweeping at once only delete the same objects twice.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from core.db import read_session
from core.descriptor import file_key
from core.jobs import adapter_id_for_job, job_id_for_adapter, job_id_for_results_file, results_file_id_for_job
from core.models import Adapter, File, FineTuneJob, JobStatus
from core.storage import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

TENANTS_ROOT = "tenants/"
_ID_BATCH = 500  # ids per IN (...) query: well under every database's parameter limit


@dataclass(frozen=True)
class _Group:
    """The objects of one file or one adapter, and the newest modification among them."""

    kind: str  # file | adapter
    tenant_id: str
    object_id: str
    keys: tuple[str, ...]
    newest: float


def sweep_orphaned_objects(
    engine: Engine, store: ObjectStore, *, grace_seconds: float, at: float | None = None
) -> list[str]:
    """Delete files and adapters in the store that no row references and that are older than
    ``grace_seconds``; returns the keys removed."""
    at = time.time() if at is None else at
    groups = [g for g in _group(store.list(TENANTS_ROOT)) if g.newest < at - grace_seconds]
    if not groups:
        return []
    kept = _referenced_files(engine, [g for g in groups if g.kind == "file"])
    kept |= _referenced_adapters(engine, [g for g in groups if g.kind == "adapter"])
    removed = []
    for group in groups:
        if (group.kind, group.tenant_id, group.object_id) in kept:
            continue
        for key in group.keys:
            store.delete(key)
            removed.append(key)
        log.warning(
            "removed %s %s of tenant %s: stored, but no row refers to it", group.kind, group.object_id, group.tenant_id
        )
    return removed


def _group(objects: Iterable[ObjectInfo]) -> list[_Group]:
    keys: dict[tuple[str, str, str], list[ObjectInfo]] = defaultdict(list)
    for obj in objects:
        # tenants/{t}/files/{file} and tenants/{t}/adapters/{adapter}/{name}: the layouts of core.descriptor
        # (file_key, adapter_prefix); the listing's prefix already fixed the first part.
        parts = obj.key.split("/")
        if len(parts) == 4 and parts[2] == "files":
            keys[("file", parts[1], parts[3])].append(obj)
        elif len(parts) >= 5 and parts[2] == "adapters":
            keys[("adapter", parts[1], parts[3])].append(obj)
    return [
        _Group(kind, tenant, object_id, tuple(o.key for o in found), max(o.modified for o in found))
        for (kind, tenant, object_id), found in keys.items()
    ]


def _batches(ids: list[str]) -> Iterable[list[str]]:
    for start in range(0, len(ids), _ID_BATCH):
        yield ids[start : start + _ID_BATCH]


def _referenced_files(engine: Engine, groups: list[_Group]) -> set[tuple[str, str, str]]:
    kept = set()
    with read_session(engine) as session:
        for ids in _batches([g.object_id for g in groups]):
            rows = session.exec(select(File).where(col(File.id).in_(ids), col(File.deleted_at).is_(None))).all()
            kept |= {
                ("file", row.tenant_id, row.id) for row in rows if row.storage_key == file_key(row.tenant_id, row.id)
            }
            # A job still queued or running owns its metrics file before any row exists.
            jobs = _unfinished_jobs(session, [job_id_for_results_file(file_id) for file_id in ids])
            kept |= {("file", job.tenant_id, results_file_id_for_job(job.id)) for job in jobs}
    return kept


def _referenced_adapters(engine: Engine, groups: list[_Group]) -> set[tuple[str, str, str]]:
    kept = set()
    with read_session(engine) as session:
        for ids in _batches([g.object_id for g in groups]):
            rows = session.exec(
                select(Adapter).where(col(Adapter.id).in_(ids), col(Adapter.deleted_at).is_(None))
            ).all()
            kept |= {("adapter", row.tenant_id, row.id) for row in rows}
            # A job still queued or running owns its adapter's objects before any row exists.
            jobs = _unfinished_jobs(session, [job_id_for_adapter(adapter_id) for adapter_id in ids])
            kept |= {("adapter", job.tenant_id, adapter_id_for_job(job.id)) for job in jobs}
    return kept


def _unfinished_jobs(session: Session, job_ids: list[str]) -> Sequence[FineTuneJob]:
    """Those of ``job_ids`` that exist and have not ended."""
    stmt = select(FineTuneJob).where(
        col(FineTuneJob.id).in_(job_ids), col(FineTuneJob.status).not_in(JobStatus.TERMINAL)
    )
    return session.exec(stmt).all()
