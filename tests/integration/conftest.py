"""Integration fixtures for the training path: a private slice of the session's real services (its own
SQLite database, S3 bucket and training queue) and real Celery worker processes on it.

Typical use::

    def test_a_job_runs(platform, worker):           # a worker already consumes platform's queue
        ...create the job row, then enqueue_job(platform.celery, job)...
        job = platform.wait_for_job(job_id, worker=worker)

    def test_a_crash(platform, start_worker):        # start, kill -9 and restart workers yourself
        first = start_worker(platform.settings)
        first.kill()                                 # SIGKILL to the whole worker (pool included)
        second = start_worker(platform.settings)

    # any Settings work, e.g. a session-scoped API's; or, at any scope:
    proc = launch_worker(settings, log_path); ...; proc.stop()

Workers are ``python -m core worker`` processes (``core.local_services.ManagedProcess``: ``pid``,
``alive()``, ``kill()``, ``stop()``, ``log_tail()``) with short liveness timings (``TEST_WORKER_TIMING``)
so a killed worker's job is requeued within seconds. Each platform has its own base model name, hence
its own queue, so workers of different tests never take each other's jobs.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
from celery import Celery
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from core import db
from core.local_services import EmbeddedRedis, ManagedProcess, free_port
from core.models import FineTuneJob, JobEvent, JobStatus
from core.queue import make_celery
from core.settings import ENV_PREFIX, Settings, load_settings
from core.storage import ObjectStore, open_store
from tests.services import S3Service

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")

# Seconds. A running job heartbeats every 0.5 s; one silent for 6 s is requeued by a reaper that looks
# every second, so a `kill -9` test waits seconds, not the production two minutes.
TEST_WORKER_TIMING = {
    "HEARTBEAT_SECONDS": "0.5",
    "STALE_AFTER_SECONDS": "6",
    "REAP_EVERY_SECONDS": "1",
    "RETRY_DELAY_SECONDS": "1",
}


def settings_env(settings: Settings) -> dict[str, str]:
    """``LORAPLEX_*`` variables that make a child process load the same ``settings``."""
    return settings.as_env()


WORKER_METRICS_PORT = f"{ENV_PREFIX}WORKER_METRICS_PORT"


def launch_worker(settings: Settings, log_path: Path, **timing: str) -> ManagedProcess:
    """Start ``loraplex worker`` (concurrency 1) for ``settings``; ``timing`` overrides ``TEST_WORKER_TIMING``.

    It is not waited for: jobs wait in Redis until it consumes them. Stop it with ``.stop()`` (warm
    shutdown, then KILL) or crash it with ``.kill()``.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update(settings_env(settings))
    env.update({f"{ENV_PREFIX}WORKER_{k}": v for k, v in {**TEST_WORKER_TIMING, **timing}.items()})
    env.setdefault(WORKER_METRICS_PORT, str(free_port()))  # read it back from the process's env
    env["PYTHONUNBUFFERED"] = "1"
    # Test machines are shared and oversubscribed; OpenMP threads spin-waiting for descheduled siblings
    # make a tiny model's steps ~20x slower than one thread does (measured: 144 s vs 9 s per job).
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "core", "worker", "--concurrency", "1", "--loglevel", "info"]
    return ManagedProcess("worker", argv, log_path, env=env, cwd=REPO_ROOT).start()


@dataclass
class Platform:
    """Settings, database, object store and Celery producer of one isolated slice of the test services."""

    settings: Settings
    workdir: Path
    engine: Engine
    store: ObjectStore
    celery: Celery

    def session(self) -> AbstractContextManager[Session]:
        """A short transaction on the platform's database."""
        return db.session_scope(self.engine)

    def job(self, job_id: str) -> FineTuneJob:
        with self.session() as session:
            job = session.get(FineTuneJob, job_id)
        assert job is not None, f"no job {job_id}"
        return job

    def events(self, job_id: str) -> list[JobEvent]:
        """The job's events, oldest first."""
        with self.session() as session:
            return list(session.exec(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all())

    def wait_until(
        self,
        probe: Callable[[], T | None],
        what: str,
        *,
        timeout: float = 180.0,
        worker: ManagedProcess | None = None,
    ) -> T:
        """Poll ``probe`` until it returns something truthy; fail with ``what`` (and the worker's log
        tail) at the deadline, or at once if ``worker`` died."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if worker is not None and not worker.alive():
                pytest.fail(f"worker exited while waiting for {what}:\n{worker.log_tail(60)}")
            if time.monotonic() > deadline:
                tail = worker.log_tail(60) if worker is not None else "(no worker given)"
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; worker log:\n{tail}")
            time.sleep(0.1)

    def wait_for_job(
        self,
        job_id: str,
        statuses: Collection[str] = JobStatus.TERMINAL,
        *,
        timeout: float = 180.0,
        worker: ManagedProcess | None = None,
    ) -> FineTuneJob:
        """Poll the job row until its status is one of ``statuses`` (default: any terminal one)."""

        def probe() -> FineTuneJob | None:
            job = self.job(job_id)
            return job if job.status in statuses else None

        return self.wait_until(probe, f"job {job_id} to reach {sorted(statuses)}", timeout=timeout, worker=worker)

    def close(self) -> None:
        self.celery.close()
        self.engine.dispose()


def make_platform(workdir: Path, redis: EmbeddedRedis, s3: S3Service, base_model: Path) -> Platform:
    """A fresh database, bucket and queue (a unique base model name) on the given services."""
    workdir.mkdir(parents=True, exist_ok=True)
    settings = load_settings(
        data_dir=workdir,
        database_url=f"sqlite:///{workdir / 'loraplex.db'}",
        redis_url=redis.url,
        storage_backend="s3",
        s3_endpoint=s3.endpoint,
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
        s3_bucket=f"w-{uuid.uuid4().hex[:20]}",
        base_model=base_model,
        base_model_name=f"tiny-{uuid.uuid4().hex[:8]}",
    )
    db.upgrade(settings.db_url)
    return Platform(settings, workdir, db.make_engine(settings.db_url), open_store(settings), make_celery(settings))


@pytest.fixture
def platform(
    tmp_path: Path, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Platform]:
    """A private database, bucket and queue for one test."""
    platform = make_platform(tmp_path / "platform", redis_service, s3_service, tiny_model_dir)
    yield platform
    platform.close()


@pytest.fixture(scope="module")
def module_platform(
    tmp_path_factory: pytest.TempPathFactory, redis_service: EmbeddedRedis, s3_service: S3Service, tiny_model_dir: Path
) -> Iterator[Platform]:
    """Like ``platform``, shared by the tests of one module (tests must then use their own tenants)."""
    platform = make_platform(tmp_path_factory.mktemp("platform"), redis_service, s3_service, tiny_model_dir)
    yield platform
    platform.close()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., ManagedProcess]]:
    """Start workers with ``start_worker(settings, **timing)``; all are stopped when the test ends."""
    started: list[ManagedProcess] = []

    def start(settings: Settings, **timing: str) -> ManagedProcess:
        proc = launch_worker(settings, tmp_path / f"worker-{len(started)}.log", **timing)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def worker(platform: Platform, start_worker: Callable[..., ManagedProcess]) -> ManagedProcess:
    """One worker consuming ``platform``'s queue for this test."""
    return start_worker(platform.settings)


@pytest.fixture(scope="module")
def module_worker(module_platform: Platform) -> Iterator[ManagedProcess]:
    """One worker consuming ``module_platform``'s queue for a whole module."""
    proc = launch_worker(module_platform.settings, module_platform.workdir / "worker.log")
    yield proc
    proc.stop()
