"""The upkeep that keeps jobs from being stuck (the reaper and the lost-message requeue) runs in a
``loraplex worker`` started as production starts it, with the default timings rather than the tests'
short ones: its first pass, at start-up, already fails a job whose worker died on its last attempt and
sends again a queued job whose message was lost."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest

from core.local_services import ManagedProcess
from core.models import JobStatus
from tests.integration.conftest import Platform
from tests.integration.training.jobs import jsonl, memorable_rows, submit_job
from worker.lifecycle import MAX_ATTEMPTS_CODE
from worker.runtime import WorkerOptions

pytestmark = pytest.mark.slow
LONG_AGO = 10_000.0  # seconds: stale under any timing


def production_timing() -> dict[str, str]:
    """``WorkerOptions``' defaults, as the ``LORAPLEX_WORKER_*`` values ``launch_worker`` sets."""
    return {name.upper(): str(value) for name, value in dataclasses.asdict(WorkerOptions()).items()}


def test_a_default_worker_reaps_and_requeues_on_its_first_pass(
    platform: Platform, start_worker: Callable[..., ManagedProcess]
) -> None:
    dead = submit_job(platform, "upkeep", jsonl(memorable_rows(1)), enqueue=False)
    lost = submit_job(platform, "upkeep", jsonl(memorable_rows(2)), enqueue=False)  # queued, never sent
    with platform.session() as session:
        for job_id, fields in [
            # Its last attempt's worker (on another machine, so only the heartbeat tells) went silent.
            (dead.id, {"status": JobStatus.RUNNING, "attempts": 3, "worker_id": "gone:1", "heartbeat_at": 1.0}),
            (lost.id, {"queued_at": time.time() - LONG_AGO}),
        ]:
            job = platform.job(job_id)
            for name, value in fields.items():
                setattr(job, name, value)
            session.add(job)

    worker = start_worker(platform.settings, **production_timing())

    failed = platform.wait_for_job(dead.id, timeout=120, worker=worker)
    assert (failed.status, failed.error_code) == (JobStatus.FAILED, MAX_ATTEMPTS_CODE)
    requeued = lambda: any("place in the queue was lost" in e.message for e in platform.events(lost.id))  # noqa: E731
    platform.wait_until(requeued, "the lost job to be sent again", timeout=120, worker=worker)
