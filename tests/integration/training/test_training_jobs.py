"""Jobs through a real Celery worker on real Redis and S3: success, bad data, cancellation, two tenants.

One worker serves the whole module, as one would serve a GPU, so jobs here also run back to back.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import redis
from sqlmodel import col, select

from core.base_fingerprint import fingerprint_base, read_adapter_origin
from core.descriptor import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS, adapter_prefix
from core.jobs import request_cancel
from core.local_services import ManagedProcess
from core.models import Adapter, FineTuneJob, JobStatus, UsageRecord
from core.queue import ADAPTER_EVENTS_CHANNEL, train_queue
from core.storage import sha256_file
from tests.integration.conftest import WORKER_METRICS_PORT, Platform
from tests.integration.training.jobs import (
    MEMORISE,
    adapter_objects,
    download_adapter,
    jsonl,
    memorable_rows,
    reproduction_rate,
    submit_job,
    train_losses,
)
from tests.prometheus import Metrics

pytestmark = pytest.mark.slow


def adapters_of(platform: Platform, tenant_id: str) -> list[Adapter]:
    """The tenant's trained adapters: jobs' results, their epoch checkpoints apart."""
    with platform.session() as session:
        stmt = select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.source == "fine_tune")
        return list(session.exec(stmt).all())


def test_a_job_trains_an_adapter_that_reproduces_its_training_data(
    module_platform: Platform, module_worker: ManagedProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    platform = module_platform
    rows = memorable_rows(seed=0)
    subscriber = redis.Redis.from_url(platform.settings.redis_url or "").pubsub()
    subscriber.subscribe(ADAPTER_EVENTS_CHANNEL)
    job = submit_job(platform, "acme", jsonl(rows), suffix="codes")

    seen: list[str] = []

    def terminal() -> FineTuneJob | None:
        current = platform.job(job.id)
        if not seen or seen[-1] != current.status:
            seen.append(current.status)
        return current if current.status in JobStatus.TERMINAL else None

    job = platform.wait_until(terminal, f"job {job.id} to end", worker=module_worker)
    assert job.status == JobStatus.SUCCEEDED, (job.error_code, job.error_message)
    assert set(seen) <= {JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.SUCCEEDED}
    assert seen == sorted(seen, key=[JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.SUCCEEDED].index)

    events = platform.events(job.id)
    messages = [e.message for e in events]
    assert messages.index("Fine-tuning job started") < messages.index("The job has successfully completed")
    losses = train_losses(events)
    assert len(losses) == 160  # 16 examples / batch 4 x 40 epochs: one metrics event per step
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 / 10, losses

    # The worker's /metrics counts the attempt (trained in a pool process) and reads its queue's depth.
    assert module_worker.env is not None
    scrape = Metrics(httpx.get(f"http://127.0.0.1:{module_worker.env[WORKER_METRICS_PORT]}/metrics", timeout=10).text)
    assert scrape.value("loraplex_worker_job_duration_seconds_count", method="supervised", outcome="succeeded") >= 1
    queue = train_queue(platform.settings.model_name or "")
    assert scrape.has("loraplex_worker_queue_depth", queue=queue)
    assert scrape.value("loraplex_worker_queue_depth", queue=queue) == 0

    [adapter] = adapters_of(platform, job.tenant_id)
    assert job.fine_tuned_model == adapter.name == f"ft:{platform.settings.model_name}:acme:codes:{job.id}"
    assert job.adapter_id == adapter.id and adapter.job_id == job.id
    assert adapter.storage_prefix == adapter_prefix(job.tenant_id, adapter.id)
    keys = sorted(obj.key for obj in platform.store.list(adapter.storage_prefix))
    assert keys == sorted(adapter.storage_prefix + n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_MANIFEST))
    # Everything else the tenant stores is the job's three kept epoch checkpoints.
    with platform.session() as session:
        live = col(Adapter.deleted_at).is_(None)  # a slow run retires checkpoints older than the last three
        stmt = select(Adapter).where(Adapter.job_id == job.id, Adapter.source == "checkpoint", live)
        checkpoints = session.exec(stmt).all()
    assert len(checkpoints) == 3
    assert {o.key.split("/")[3] for o in adapter_objects(platform, job.tenant_id)} == {
        adapter.id,
        *(c.id for c in checkpoints),
    }

    local = download_adapter(platform, job.tenant_id, adapter.id, tmp_path / "adapter")
    assert sha256_file(local / ADAPTER_WEIGHTS) == adapter.sha256
    assert sha256_file(local / ADAPTER_CONFIG) == adapter.config_sha256
    manifest = json.loads((local / ADAPTER_MANIFEST).read_text())
    for name, meta in manifest["files"].items():
        assert sha256_file(local / name) == meta["sha256"]
    base = fingerprint_base(tiny_model_dir, adapter.base_model)
    assert (
        manifest["base_model"]
        == {"name": adapter.base_model, "fingerprint": base.digest}
        == {
            "name": read_adapter_origin(local / ADAPTER_WEIGHTS).base_model,
            "fingerprint": adapter.base_fingerprint,
        }
    )
    assert (manifest["rank"], adapter.rank) == (MEMORISE["lora_r"], MEMORISE["lora_r"])
    assert manifest["trained_tokens"] == job.trained_tokens > 0

    with platform.session() as session:
        [usage] = session.exec(select(UsageRecord).where(UsageRecord.job_id == job.id)).all()
    assert (usage.kind, usage.training_tokens, usage.adapter_id) == ("training", job.trained_tokens, adapter.id)
    assert usage.compute_seconds == job.compute_seconds > 0

    def prefetch() -> dict | None:
        message = subscriber.get_message(timeout=0.5)
        if message and message["type"] == "message":
            body = json.loads(message["data"])
            if body["adapter"]["id"] == adapter.id:
                return body
        return None

    announced = platform.wait_until(prefetch, "the prefetch announcement", timeout=10)
    assert announced["event"] == "prefetch"
    assert (announced["adapter"]["sha256"], announced["adapter"]["rank"]) == (adapter.sha256, adapter.rank)
    subscriber.close()

    assert reproduction_rate(tiny_model_dir, rows, local) >= 0.9
    assert reproduction_rate(tiny_model_dir, rows) <= 0.1


def test_a_training_file_with_errors_fails_with_its_line_numbers(
    module_platform: Platform, module_worker: ManagedProcess
) -> None:
    lines = jsonl(memorable_rows(seed=3, n=12)).decode().splitlines()
    lines[2] = '{"prompt": "Code 2:", "completion": '  # line 3: cut short
    lines[6] = json.dumps({"prompt": "Code 6:"})  # line 7: no completion
    lines[9] = json.dumps({"prompt": "Code 9:", "completion": " x" * 200})  # line 10: past max_seq_len 128
    job = submit_job(module_platform, "typo-inc", ("\n".join(lines) + "\n").encode())

    job = module_platform.wait_for_job(job.id, worker=module_worker)

    assert job.status == JobStatus.FAILED
    assert (job.error_code, job.error_param) == ("invalid_training_file", "training_file")
    for line in (3, 7, 10):
        assert f"line {line}:" in (job.error_message or "")
    assert "max_seq_len" in (job.error_message or "")
    assert module_platform.events(job.id)[-1].level == "error"
    assert adapters_of(module_platform, job.tenant_id) == []
    assert adapter_objects(module_platform, job.tenant_id) == []


def test_cancelling_a_running_job_stops_it_within_a_few_steps(
    module_platform: Platform, module_worker: ManagedProcess
) -> None:
    platform = module_platform
    job = submit_job(platform, "quitter", jsonl(memorable_rows(seed=4)), hyperparameters={**MEMORISE, "n_epochs": 100})
    platform.wait_until(lambda: len(train_losses(platform.events(job.id))) >= 5, "5 steps", worker=module_worker)

    with platform.session() as session:
        request_cancel(session, platform.job(job.id))
    steps_at_cancel = len(train_losses(platform.events(job.id)))

    job = platform.wait_for_job(job.id, worker=module_worker)
    assert job.status == JobStatus.CANCELLED
    events = platform.events(job.id)
    steps = len(train_losses(events))
    assert steps <= steps_at_cancel + 3 < 400
    # The step that saw the flag completed its update but was not logged.
    assert events[-1].message in (f"Job cancelled at step {steps}", f"Job cancelled at step {steps + 1}")
    assert adapters_of(platform, job.tenant_id) == []
    assert adapter_objects(platform, job.tenant_id) == []
    assert job.fine_tuned_model is None


def test_two_tenants_jobs_run_back_to_back_without_mixing_their_data(
    module_platform: Platform, module_worker: ManagedProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    platform = module_platform
    # Same prompts, different answers: an adapter that saw the other tenant's data could not get both right.
    rows = {"north": memorable_rows(seed=11), "south": memorable_rows(seed=12)}
    jobs = {name: submit_job(platform, name, jsonl(data)) for name, data in rows.items()}

    for name, job in jobs.items():
        jobs[name] = platform.wait_for_job(job.id, worker=module_worker)
        assert jobs[name].status == JobStatus.SUCCEEDED, jobs[name].error_message

    north, south = jobs["north"], jobs["south"]
    assert north.tenant_id != south.tenant_id
    local = {}
    for name, job in jobs.items():
        [adapter] = adapters_of(platform, job.tenant_id)
        assert adapter.name.split(":")[2] == name
        assert len(platform.store.list(adapter.storage_prefix)) == 3
        local[name] = download_adapter(platform, job.tenant_id, adapter.id, tmp_path / name)
    assert reproduction_rate(tiny_model_dir, rows["north"], local["north"]) >= 0.9
    assert reproduction_rate(tiny_model_dir, rows["south"], local["south"]) >= 0.9
    assert reproduction_rate(tiny_model_dir, rows["south"], local["north"]) <= 0.1
    assert reproduction_rate(tiny_model_dir, rows["north"], local["south"]) <= 0.1
