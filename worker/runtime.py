"""What a worker process keeps between jobs: settings, options, and lazily opened DB, store and fingerprint.

Opened lazily so that nothing with sockets or threads crosses the fork into Celery's pool processes;
``after_fork`` drops anything that did.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery
from sqlalchemy.engine import Engine

from core.base_fingerprint import BaseFingerprint, fingerprint_base
from core.db import make_engine
from core.errors import ConfigError
from core.model_source import resolve_model_dir
from core.settings import Settings
from core.storage import ObjectStore, open_store


@dataclass(frozen=True)
class WorkerOptions:
    """Liveness timing: a running job heartbeats every ``heartbeat_seconds``; one silent for
    ``stale_after_seconds`` is requeued by the reaper, which runs every ``reap_every_seconds`` (and also sends
    again the message of a job queued that long whose message is missing). Stored objects no row refers
    to are removed once ``orphan_grace_seconds`` old, by a sweep that runs every quarter of that. A job's
    last three epochs always leave a checkpoint; earlier epochs at most one per ``checkpoint_interval_seconds``
    (what a crash can cost, besides the epoch it happened in)."""

    heartbeat_seconds: float = 10.0
    stale_after_seconds: float = 120.0
    reap_every_seconds: float = 30.0
    retry_delay_seconds: float = 30.0  # before retrying a job that hit a transient error (store down)
    orphan_grace_seconds: float = 3600.0
    checkpoint_interval_seconds: float = 60.0
    train_threads: int | None = None  # torch threads a job trains with (its share of the machine); None: torch's

    def __post_init__(self) -> None:
        if (
            min(self.heartbeat_seconds, self.reap_every_seconds) <= 0
            or min(self.retry_delay_seconds, self.checkpoint_interval_seconds) < 0
        ):
            raise ValueError("worker intervals must be positive")
        if self.orphan_grace_seconds < self.stale_after_seconds:
            # An upload between its objects and its row must never look abandoned.
            raise ValueError("orphan_grace_seconds must be at least stale_after_seconds")
        if self.stale_after_seconds < 3 * self.heartbeat_seconds:
            # A couple of slow beats must not get a healthy job requeued under its worker.
            raise ValueError("stale_after_seconds must be at least 3 x heartbeat_seconds")


class WorkerRuntime:
    """Per-process state of a training worker."""

    def __init__(self, settings: Settings, celery: Celery, options: WorkerOptions) -> None:
        if settings.base_model is None or settings.model_name is None:
            raise ConfigError("LORAPLEX_BASE_MODEL is not set: a worker trains adapters for one base model")
        self.settings = settings
        self.celery = celery
        self.options = options
        self.base_model_dir = resolve_model_dir(settings.base_model, setting="LORAPLEX_BASE_MODEL")
        self.base_model_name: str = settings.model_name
        self._engine: Engine | None = None
        self._store: ObjectStore | None = None
        self._fingerprint: BaseFingerprint | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = make_engine(self.settings.db_url)
        return self._engine

    @property
    def store(self) -> ObjectStore:
        if self._store is None:
            self._store = open_store(self.settings)
        return self._store

    def fingerprint(self) -> BaseFingerprint:
        """The base model's fingerprint, computed once per process."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint_base(self.base_model_dir, self.base_model_name)
        return self._fingerprint

    def after_fork(self) -> None:
        """Forget connections inherited from the parent process (they belong to it)."""
        if self._engine is not None:
            self._engine.dispose(close=False)
        self._engine = None
        self._store = None
