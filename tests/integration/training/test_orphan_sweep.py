"""The orphan sweep on the real database and S3: stored files and adapters that no row refers to (an
upload whose undo failed, a process killed between its objects and its row) are removed once past the
grace period; everything a row or an unfinished job still owns stays."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from core.descriptor import adapter_prefix, file_key
from core.ids import new_id, now
from core.jobs import adapter_id_for_job, results_file_id_for_job
from core.local_services import ManagedProcess
from core.models import Adapter, File, FineTuneJob, JobStatus
from tests.integration.conftest import Platform
from tests.integration.training.jobs import jsonl, memorable_rows, submit_job, tenant_named, upload_file
from worker.orphans import sweep_orphaned_objects

GRACE = 600.0


def later() -> float:
    """A moment by which every object the test wrote is past the grace period (taken when asked: the module is
    imported when the run starts, which on a slow run can be more than the grace period earlier)."""
    return time.time() + 2 * GRACE


def store_adapter_objects(platform: Platform, tenant_id: str, adapter_id: str) -> str:
    prefix = adapter_prefix(tenant_id, adapter_id)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        platform.store.put_bytes(prefix + name, name.encode())
    return prefix


def adapter_row(tenant_id: str, adapter_id: str) -> Adapter:
    return Adapter(
        id=adapter_id,
        tenant_id=tenant_id,
        name=f"ft:tiny:acme::{adapter_id}",
        base_model="tiny",
        source="upload",
        storage_prefix=adapter_prefix(tenant_id, adapter_id),
        sha256="0" * 64,
        config_sha256="0" * 64,
        rank=8,
        alpha=16.0,
    )


def set_job_status(platform: Platform, job: FineTuneJob, status: str) -> None:
    with platform.session() as session:
        row = session.get(FineTuneJob, job.id)
        assert row is not None
        row.status = status
        session.add(row)


def test_only_objects_nothing_refers_to_are_removed(platform: Platform) -> None:
    tenant = tenant_named(platform, "acme").id
    live_file = upload_file(platform, tenant_named(platform, "acme"), b"{}\n")
    deleted_file = upload_file(platform, tenant_named(platform, "acme"), b"{}\n")
    with platform.session() as session:
        row = session.get(File, deleted_file.id)
        assert row is not None
        row.deleted_at = now()
        session.add(row)
    unrecorded_file = file_key(tenant, new_id("file"))  # the row insert failed and so did its undo
    platform.store.put_bytes(unrecorded_file, b"{}\n")

    live_adapter = store_adapter_objects(platform, tenant, "adapter-live")
    crashed_upload = store_adapter_objects(platform, tenant, "adapter-crashed")
    with platform.session() as session:
        session.add(adapter_row(tenant, "adapter-live"))

    running = submit_job(platform, "acme", jsonl(memorable_rows(0)), enqueue=False)
    set_job_status(platform, running, JobStatus.RUNNING)  # uploaded, about to record its adapter
    running_prefix = store_adapter_objects(platform, tenant, adapter_id_for_job(running.id))
    failed = submit_job(platform, "acme", jsonl(memorable_rows(1)), enqueue=False)
    set_job_status(platform, failed, JobStatus.FAILED)  # its cleanup could not reach the store
    failed_prefix = store_adapter_objects(platform, tenant, adapter_id_for_job(failed.id))
    # Metrics files stored before their job's success is recorded: kept while the job runs, not after it failed.
    running_results = file_key(tenant, results_file_id_for_job(running.id))
    failed_results = file_key(tenant, results_file_id_for_job(failed.id))
    for key in (running_results, failed_results):
        platform.store.put_bytes(key, b"step,train_loss\n")

    not_ours = f"tenants/{tenant}/exports/report.csv"
    platform.store.put_bytes(not_ours, b"a,b\n")
    # Another tenant's path holding a live adapter's id is not that adapter.
    elsewhere = store_adapter_objects(platform, "tenant-other", "adapter-live")

    before = {o.key for o in platform.store.list("tenants/")}
    assert sweep_orphaned_objects(platform.engine, platform.store, grace_seconds=GRACE) == []  # all too young

    removed = set(sweep_orphaned_objects(platform.engine, platform.store, grace_seconds=GRACE, at=later()))

    gone = {deleted_file.storage_key, unrecorded_file, failed_results}
    for prefix in (crashed_upload, failed_prefix, elsewhere):
        gone |= {k for k in before if k.startswith(prefix)}
    assert removed == gone
    remaining = {o.key for o in platform.store.list("tenants/")}
    assert remaining == before - gone
    assert live_file.storage_key in remaining and not_ours in remaining and running_results in remaining
    assert any(k.startswith(live_adapter) for k in remaining) and any(k.startswith(running_prefix) for k in remaining)
    assert sweep_orphaned_objects(platform.engine, platform.store, grace_seconds=GRACE, at=later()) == []


@pytest.mark.slow
def test_a_worker_sweeps_an_orphan_on_its_own(platform: Platform, start_worker: Callable[..., ManagedProcess]) -> None:
    tenant = tenant_named(platform, "acme").id
    orphan = file_key(tenant, new_id("file"))
    platform.store.put_bytes(orphan, b"{}\n")
    worker = start_worker(platform.settings, ORPHAN_GRACE_SECONDS="6")  # the tests' stale_after: the least allowed

    platform.wait_until(lambda: not platform.store.exists(orphan), "the orphan to be swept", timeout=120, worker=worker)
