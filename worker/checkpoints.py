"""A running job's checkpoints in the store and the database: saved as epochs end, resumed from after a crash.

A checkpoint is an adapter like any other (servable by its model name, listed in ``/v1/models``) whose
objects also hold the training state under ``{prefix}state/``, plus a ``FineTuningCheckpoint`` row. Objects
go up first, then one transaction on the locked job records both rows, only while this attempt still holds
the job, and retires checkpoints beyond the newest ``KEEP_CHECKPOINTS``; their objects are removed after it
commits (the orphan sweep finishes what a crash interrupts). A later attempt resumes from the newest one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from core.db import read_session, session_scope
from core.descriptor import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_prefix
from core.errors import ObjectNotFound
from core.ids import new_id
from core.jobs import (
    fine_tuned_model_name,
    live_checkpoints,
    lock_job,
    record_event,
    retire_adapter_row,
    retire_checkpoints,
)
from core.models import Adapter, FineTuneJob, FineTuningCheckpoint, Tenant
from core.settings import Settings
from core.storage import ObjectStore
from trainer.progress import KEEP_CHECKPOINTS, Checkpoint
from worker.announce import announce_unload
from worker.lifecycle import Lease
from worker.upload import UploadedAdapter, find_uploaded_adapter, remove_adapter_objects, upload_adapter

log = logging.getLogger(__name__)
STATE = "state/"


def checkpoint_model_name(job_model_name: str, step: int) -> str:
    """OpenAI's checkpoint name: the job's model name and ``:ckpt-step-{step}``."""
    return f"{job_model_name}:ckpt-step-{step}"


@dataclass(frozen=True)
class StoredCheckpoint:
    """The newest checkpoint of a job, downloaded to resume from."""

    step: int
    epoch: int
    adapter_dir: Path
    state_dir: Path


def save_checkpoint(
    settings: Settings, engine: Engine, store: ObjectStore, lease: Lease, checkpoint: Checkpoint
) -> bool:
    """Store ``checkpoint`` and record it for the leased job; False (and nothing left behind) when the lease
    was lost meanwhile. Store errors propagate (the attempt fails as a transient outage). Servers are told to
    unload the checkpoints it retires."""
    with read_session(engine) as session:
        job = session.get(FineTuneJob, lease.job_id)
    assert job is not None  # the lease holder's job exists
    adapter_id = new_id("adapter")
    prefix = adapter_prefix(job.tenant_id, adapter_id)
    uploaded = upload_adapter(store, checkpoint.adapter_dir, prefix)
    try:
        for path in sorted(checkpoint.state_dir.iterdir()):
            store.put_file(prefix + STATE + path.name, path)
        retired = _record(engine, lease, uploaded, adapter_id, checkpoint)
    except BaseException:
        remove_adapter_objects(store, prefix)
        raise
    if retired is None:
        remove_adapter_objects(store, prefix)
        return False
    for old in retired:
        remove_adapter_objects(store, old.storage_prefix)
    announce_unload(settings, retired)
    return True


def _record(
    engine: Engine, lease: Lease, uploaded: UploadedAdapter, adapter_id: str, checkpoint: Checkpoint
) -> list[Adapter] | None:
    """Add the checkpoint's rows and retire the oldest beyond the kept ones, in one transaction; the retired
    adapters, or None when the lease is lost."""
    with session_scope(engine) as session:
        job = lock_job(session, lease.job_id)
        if job is None or not lease.held_by(job):
            return None
        tenant = session.get(Tenant, job.tenant_id)
        assert tenant is not None  # jobs reference tenants by foreign key
        job_model = fine_tuned_model_name(job.base_model, tenant.name, job.suffix, job.id)
        name = checkpoint_model_name(job_model, checkpoint.step)
        retired = []
        # An earlier attempt may have saved this step already (its objects incomplete, so training started
        # over) or the tenant deleted it before the crash: that row gives its name up.
        clash = session.exec(select(Adapter).where(Adapter.name == name)).first()
        if clash is not None:
            if retire_adapter_row(session, clash, cause=f"job:{job.id}", reason="checkpoint_replaced"):
                retired.append(clash)
            for stale in session.exec(select(FineTuningCheckpoint).where(FineTuningCheckpoint.adapter_id == clash.id)):
                session.delete(stale)
        session.flush()
        adapter = uploaded.adapter_row(adapter_id, job, name, "checkpoint")
        row = FineTuningCheckpoint(
            id=new_id("ftckpt"),
            job_id=job.id,
            tenant_id=job.tenant_id,
            adapter_id=adapter_id,
            step_number=checkpoint.step,
            epoch=checkpoint.epoch,
            metrics=checkpoint.metrics,
        )
        session.add(adapter)
        session.add(row)
        message = f"Checkpoint created at step {checkpoint.step} (epoch {checkpoint.epoch}): {adapter.name}"
        record_event(session, job, message, data={"step": checkpoint.step, "checkpoint": row.id})
        session.flush()
        return retired + retire_checkpoints(session, job.id, keep=KEEP_CHECKPOINTS)


def newest_checkpoint(engine: Engine, job_id: str) -> tuple[FineTuningCheckpoint, Adapter] | None:
    """The job's newest checkpoint whose adapter is still live (a tenant may have deleted it)."""
    with read_session(engine) as session:
        newest = session.exec(live_checkpoints(job_id).order_by(col(FineTuningCheckpoint.step_number).desc())).first()
    return (newest[0], newest[1]) if newest is not None else None


def fetch_checkpoint(engine: Engine, store: ObjectStore, job_id: str, dest: Path) -> StoredCheckpoint | None:
    """Download the job's newest checkpoint, verified, into ``dest``; None when the job has none that is whole
    (training then starts over, as it did before checkpoints). A store outage raises ``StorageError``: the
    attempt is retried later rather than thrown away."""
    found = newest_checkpoint(engine, job_id)
    if found is None:
        return None
    row, adapter = found
    adapter_dir, state_dir = dest / "adapter", dest / "state"
    uploaded = find_uploaded_adapter(store, adapter.storage_prefix)
    state = store.list(adapter.storage_prefix + STATE)
    if uploaded is None or not state:
        log.warning("job %s: checkpoint %s is incomplete in the store; training starts over", job_id, row.id)
        return None
    try:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            expected = uploaded.manifest["files"][name]["sha256"]
            store.get_file(adapter.storage_prefix + name, adapter_dir / name, expected_sha256=expected)
        for info in state:
            store.get_file(info.key, state_dir / info.key.rsplit("/", 1)[-1], expected_sha256=info.sha256)
    except ObjectNotFound:  # deleted between the listing and the download (the tenant deleted the checkpoint)
        log.warning("job %s: checkpoint %s vanished while downloading; training starts over", job_id, row.id)
        return None
    return StoredCheckpoint(row.step_number, row.epoch, adapter_dir, state_dir)
